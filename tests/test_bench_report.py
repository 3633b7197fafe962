"""The README's benchmark figures are generated from bench/results/*.json by bench/report.py:
every block matches its file, and a figure edited by hand is caught."""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import report  # noqa: E402


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_every_benchmark_result_file_has_its_block_in_the_readme_and_each_block_matches_its_file():
    assert report.problems(readme()) == []


def test_every_benchmark_make_bench_runs_writes_a_result_file_the_readme_shows():
    with open(os.path.join(ROOT, "Makefile")) as f:
        bench = f.read().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    ran = set(re.findall(r"bench/(\w+)\.py", bench)) - {"report"}
    assert ran == set(report.RENDER)
    for name in ran:
        assert f"<!-- bench:{name} -->" in readme()


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
