"""The benchmark figures (docs/benchmarks.md) are generated from bench/results/*.json by bench/report.py:
every block matches its file, and a figure edited by hand is caught."""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import report  # noqa: E402


def readme():
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        return f.read()


def test_every_benchmark_result_file_has_its_block_on_the_benchmarks_page_and_each_block_matches_its_file():
    assert report.problems(readme()) == []


def test_every_benchmark_make_bench_runs_writes_a_result_file_the_readme_shows():
    with open(os.path.join(ROOT, "Makefile")) as f:
        bench = f.read().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    ran = set(re.findall(r"bench/(\w+)\.py", bench)) - {"report"}
    assert ran == set(report.RENDER)
    for name in ran:
        if name in report.PAGES:  # a page of docs/ holds it, and the README links to that page
            with open(report.PAGES[name]) as f:
                assert f"<!-- bench:{name} -->" in f.read()
            assert os.path.relpath(report.PAGES[name], ROOT) in readme()
        else:
            assert f"<!-- bench:{name} -->" in readme()


def test_a_page_of_docs_with_a_benchmark_block_matches_its_file():
    for name, page in report.PAGES.items():
        with open(page) as f:
            assert report.problems(f.read(), names=[name]) == []


def test_the_projects_readme_summarises_the_io_benchmark_from_its_file_and_a_hand_edit_is_caught():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert report.problems(text, names=list(report.SUMMARIES)) == []
    block = re.search(r"<!-- bench:io-summary -->\n(.*?)<!-- /bench:io-summary -->", text, re.S).group(1)
    assert "target at most 1.2x" in block and "safetensors" in block and "torch.load(mmap=True)" in block
    m = re.search(r"\| (\d+)\.(\d\d) s \|", block)
    edited = text.replace(m.group(0), f"| {int(m.group(1)) + 1}.{m.group(2)} s |", 1)
    assert report.problems(edited, names=list(report.SUMMARIES)) == [
        "block bench:io-summary differs from bench/results/io.json (run python bench/report.py)"
    ]
    gone = re.sub(r"<!-- bench:io-summary -->\n.*?<!-- /bench:io-summary -->\n", "", text, flags=re.S)
    assert report.problems(gone, names=list(report.SUMMARIES)) == [
        "no block <!-- bench:io-summary --> for bench/results/io.json"
    ]


def test_a_figure_changed_by_hand_in_the_readme_is_reported():
    text = readme()
    m = re.search(r"<!-- bench:overhead -->\n.*?(\d+) ms", text, re.S)
    edited = text[: m.start(1)] + str(int(m.group(1)) + 1) + text[m.end(1) :]
    assert report.problems(edited) == [
        "block bench:overhead differs from bench/results/overhead.json (run python bench/report.py)"
    ]


def test_a_result_file_without_its_block_in_the_readme_is_reported():
    text = re.sub(r"<!-- bench:scale -->\n.*?<!-- /bench:scale -->\n", "", readme(), flags=re.S)
    assert report.problems(text) == ["no block <!-- bench:scale --> for bench/results/scale.json"]


def test_rewriting_puts_each_files_figures_between_its_markers():
    empty = re.sub(r"(<!-- bench:(\w+) -->\n).*?(<!-- /bench:\2 -->)", r"\1\3", readme(), flags=re.S)
    assert report.problems(empty) != []
    assert report.rewrite(empty) == readme()


def test_a_later_run_is_compared_figure_by_figure_with_the_readmes_run(tmp_path):
    import json
    import shutil

    yes, no = report.reproduced(report.RESULTS, report.RESULTS)  # a run reproduces itself
    assert yes and not no
    for name in report.RENDER:
        shutil.copy(os.path.join(report.RESULTS, f"{name}.json"), tmp_path)
    with open(tmp_path / "resume.json") as f:
        res = json.load(f)
    res["rows"][-1]["ours_s"]["median"] = 10 * res["rows"][-1]["ours_s"]["max"]  # a run 10x slower
    with open(tmp_path / "resume.json", "w") as f:
        json.dump(res, f)
    yes, no = report.reproduced(report.RESULTS, str(tmp_path))
    assert len(no) == 1 and no[0].startswith("resume: rows[2].ours_s: ")


def test_the_rounds_of_several_runs_are_pooled_into_each_figure_and_the_readme_names_the_runs(tmp_path):
    import json
    import shutil

    runs = [tmp_path / "a", tmp_path / "b"]
    for k, d in enumerate(runs):
        d.mkdir()
        for name in report.RENDER:
            shutil.copy(os.path.join(report.RESULTS, f"{name}.json"), d)
        with open(d / "resume.json") as f:
            res = json.load(f)
        res["machine"].pop("runs", None)  # the committed results may themselves be pooled
        res["machine"]["date"] = f"2026-12-0{k + 1} 10:00 UTC"
        res["rows"][-1]["ours_s"]["values"] = [float(k + 1)] * 3  # run a: 1 s x 3, run b: 2 s x 3
        with open(d / "resume.json", "w") as f:
            json.dump(res, f)
    out = tmp_path / "pooled"
    assert set(report.merge([str(d) for d in runs], str(out))) == set(report.RENDER)
    with open(out / "resume.json") as f:
        pooled = json.load(f)
    with open(runs[0] / "resume.json") as f:
        one = json.load(f)
    s = pooled["rows"][-1]["ours_s"]
    assert s["values"] == [1.0] * 3 + [2.0] * 3 and s["min"] == 1.0 and s["max"] == 2.0 and s["n"] == 6
    assert pooled["rounds"] == 2 * one["rounds"]
    assert pooled["rows"][0]["k"] == one["rows"][0]["k"]  # what is not a figure stays as it was
    text = report.render_file("resume", str(out / "resume.json"))
    assert "Measured in 2 runs (2026-12-01 10:00 UTC, 2026-12-02 10:00 UTC), the rounds pooled," in text
