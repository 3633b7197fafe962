"""The benchmark figures, generated from the JSON files `make bench` writes into bench/results/: each
benchmark's table sits in docs/benchmarks.md (or, for those in `PAGES`, in its own page of docs/) between
`<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, and nothing between them is written by hand.

    python bench/report.py           # rewrite those blocks of docs/benchmarks.md from bench/results/*.json
    python bench/report.py --check   # exit 1 if docs/benchmarks.md differs from what the files give
    python bench/report.py --reproduces OLD_DIR  # which figures of an earlier run's files this run's reproduce
    python bench/report.py --merge DIR1 DIR2 ... # pool the rounds of several runs into bench/results/

Pure JSON -> Markdown (no torch, no fastai), so the test suite can check the README quickly.
"""

import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
README = os.path.join(HERE, "..", "docs", "benchmarks.md")  # the page the tables live in
sys.path.insert(0, HERE)
import common  # noqa: E402  (statistics of rounds; torch only inside common.machine)

BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)


def _mm(s, scale=1.0, fmt="{:.2f}"):
    "A median with its range over rounds."
    return f"{fmt.format(s['median'] * scale)} ({fmt.format(s['min'] * scale)} to {fmt.format(s['max'] * scale)})"


def machine_line(res) -> str:
    m = res["machine"]
    d = m["disk"]
    runs = m.get("runs", [m["date"]])
    when = (
        f"Measured {m['date']}"
        if len(runs) == 1
        else f"Measured in {len(runs)} runs ({', '.join(runs)}), the rounds pooled,"
    )
    return (
        f"{when} by `{res['command']}`: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, "
        f"{d['fs']} on {d['device']}, load average {m['loadavg_at_start']:.1f} at the start (a machine shared with "
        f"other work), torch {m['torch']} with {m['torch_threads']} threads; {res['rounds']} rounds."
    )


def paired(res) -> list:
    "The paired-segment table: each save's cost against the steps beside it, as overheads at several intervals."
    p = res["paired"]
    step, n = p["step_s"]["median"], p["segment_steps"]
    intervals = sorted({row["every"] for row in res["rows"] if row["every"] * step > 0.5} | {2 * n}, reverse=True)

    def pct(c, every):
        return {k: 100 * c[k] / (every * step) for k in ("median", "min", "max")}

    out = [
        f"**Cost per save, paired** ({res['rounds']} rounds, {p['saves_per_run'] - 1} saves per run after its first, "
        f"steps of {1e3 * step:.1f} ms): each save's segment of {n} steps against the two segments beside it; "
        "medians (min to max) over all saves. The row without checkpointing is the method's own noise.",
        "",
        "| saves | cost per save | "
        + " | ".join(f"every {e} steps ({e * step:.2f} s)" for e in intervals)
        + " | a run's first save | stall per save |",
        "|---|---|" + "---|" * len(intervals) + "---|---|",
    ]
    names = {
        "background-buffered": "background, through the page cache",
        "background-base-pages": "background, buffers in 4 KB pages",
        "memcpy": "a memcpy of the same bytes at those steps (the limit)",
        "none": "none (the method's noise)",
    }
    for mode in ("background", "synchronous", "background-buffered", "background-base-pages", "memcpy", "none"):
        if mode not in p["cost_s"]:
            continue
        c = p["cost_s"][mode]
        cells = [_mm(pct(c, e), fmt="{:+.1f}%") for e in intervals]
        stall = _mm(p["stall_s"][mode], 1e3, "{:.0f} ms") if mode in p["stall_s"] else "—"
        first = _mm(p["first_cost_s"][mode], 1e3, "{:+.0f} ms")
        out.append(
            f"| {names.get(mode, mode)} | {_mm(c, 1e3, '{:+.0f} ms')} | "
            + " | ".join(cells)
            + f" | {first} | {stall} |"
        )
    bg, sy, no = (p["cost_s"][m]["median"] for m in ("background", "synchronous", "none"))
    verdict = [
        f"- Background {'cheaper' if bg < sy else 'not cheaper'} than synchronous per save "
        f"({1e3 * bg:+.0f} ms against {1e3 * sy:+.0f} ms; noise of the method {1e3 * no:+.0f} ms)"
        + (
            f"; written through the page cache a background save costs {1e3 * p['cost_s']['background-buffered']['median']:+.0f} ms"
            if "background-buffered" in p["cost_s"]
            else ""
        )
        + (
            f"; from buffers in 4 KB pages {1e3 * p['cost_s']['background-base-pages']['median']:+.0f} ms"
            if "background-base-pages" in p["cost_s"]
            else ""
        )
        + "."
    ]
    if "memcpy" in p["cost_s"]:
        st, lim = p["stall_s"]["background"]["median"], p["stall_s"]["memcpy"]["median"]
        verdict.append(
            f"- Stall per background save {1e3 * st:.0f} ms against {1e3 * lim:.0f} ms for a memcpy of the same "
            f"bytes at the same steps ({st / lim:.1f}x); cost per save {1e3 * bg:+.0f} ms against "
            f"{1e3 * p['cost_s']['memcpy']['median']:+.0f} ms."
        )
    for e in intervals:
        o, noise = 100 * bg / (e * step), 100 * no / (e * step)
        verdict.append(
            f"- Saving in the background every {e} steps ({e * step:.2f} s): {o:+.1f}% "
            f"(target within 5%: {'met' if o <= 5 else 'not met'}; the method's noise there {noise:+.1f}%)."
        )
    return out + [""] + verdict + [""]


def overhead(res) -> str:
    mc = res["memcpy_s"]["median"] * 1e3
    out = (paired(res) if res.get("paired") else []) + [
        f"**Whole runs**: {res['iters']} training steps of {1e3 * res['step_s']['median']:.0f} ms "
        f"(range {1e3 * res['step_s']['min']:.0f} to {1e3 * res['step_s']['max']:.0f} over rounds), "
        f"saves of {res['state_bytes'] / 1e6:.0f} MB; without checkpointing a run took "
        f"{_mm(res['none_wall_s'], fmt='{:.2f} s')} and {_mm(res['none_cpu_s'], fmt='{:.2f} s')} of CPU time "
        f"(all threads). Overheads are paired with the same round's run without "
        f"checkpointing. The stall is how long a save blocked the training loop (each run's first save "
        f"apart: a background save allocates its reusable buffers then); its limit is one copy of the "
        f"same bytes between two buffers already in memory: {mc:.0f} ms (median of the rounds).",
        "",
        "| save every | saves | background: wall overhead | synchronous: wall overhead "
        "| background: CPU overhead | synchronous: CPU overhead | background: stall per save "
        "| background: first save's stall | synchronous: stall per save | background: write time per save |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for row in res["rows"]:
        bg, sy = row["background"], row["synchronous"]
        out.append(
            f"| {row['every']} steps ({row['interval_s']:.2f} s) | {row['saves']} "
            f"| {_mm(bg['overhead_pct'], fmt='{:+.1f}%')} | {_mm(sy['overhead_pct'], fmt='{:+.1f}%')} "
            f"| {_mm(bg['cpu_overhead_pct'], fmt='{:+.1f}%')} | {_mm(sy['cpu_overhead_pct'], fmt='{:+.1f}%')} "
            f"| {_mm(bg['stall_s'], 1e3, '{:.0f} ms')} | {_mm(bg['first_stall_s'], 1e3, '{:.0f} ms')} "
            f"| {_mm(sy['stall_s'], 1e3, '{:.0f} ms')} "
            f"| {_mm(bg['write_s'], 1e3, '{:.0f} ms')} |"
        )
        o_bg, o_sy = bg["overhead_pct"]["median"], sy["overhead_pct"]["median"]
        c_bg, c_sy = bg["cpu_overhead_pct"]["median"], sy["cpu_overhead_pct"]["median"]
        spread = max(x["max"] - x["min"] for x in (bg["overhead_pct"], sy["overhead_pct"]))
        if spread > NOISE:  # a median inside a range this wide says nothing either way
            verdicts.append(
                f"- every {row['every']} steps: wall and CPU overheads not measurable on this machine "
                f"at the time (the rounds span {spread:.0f} percentage points); background stall per "
                f"save {bg['stall_s']['median'] * 1e3:.0f} ms against {sy['stall_s']['median'] * 1e3:.0f} ms "
                f"synchronous, {bg['stall_s']['median'] * 1e3 / mc:.1f}x the memcpy; the interval is "
                f"{'longer' if row['interval_s'] > bg['write_s']['median'] else 'shorter'} than a background "
                f"save's write ({row['interval_s']:.2f} s against {bg['write_s']['median']:.2f} s)."
            )
            continue
        longer = row["interval_s"] > bg["write_s"]["median"]
        verdicts.append(
            f"- every {row['every']} steps: the interval is {'longer' if longer else 'shorter'} than a "
            f"background save's write ({row['interval_s']:.2f} s against {bg['write_s']['median']:.2f} s); "
            f"background {'cheaper' if o_bg < o_sy else 'not cheaper'} than synchronous in wall time "
            f"({o_bg:+.1f}% against {o_sy:+.1f}%), {'cheaper' if c_bg < c_sy else 'not cheaper'} in CPU time "
            f"({c_bg:+.1f}% against {c_sy:+.1f}%)"
            + (f"; wall time within 5% of no checkpointing: {'met' if o_bg <= 5 else 'not met'}" if longer else "")
            + f"; background stall per save {bg['stall_s']['median'] * 1e3 / mc:.1f}x the memcpy."
        )
    return "\n".join(out + [""] + verdicts + ["", machine_line(res)])


NOISE = 20  # percentage points between the rounds' extremes beyond which no overhead verdict is given
OPS = ("save", "load", "info", "verify", "learn.load")


def scale(res) -> str:
    rows = res["rows"]
    out = ["| blocks | tensors | file | " + " | ".join(OPS) + " |", "|---|---|---|" + "---|" * len(OPS)]
    for r in rows:
        out.append(
            f"| {r['blocks']} | {r['tensors']:,} | {r['bytes'] / 1e6:.1f} MB | "
            + " | ".join(_mm(r[op], 1e3, "{:.0f} ms") for op in OPS)
            + " |"
        )
    if len(rows) >= 2:
        lo, hi = rows[0], rows[-1]
        k = hi["tensors"] / lo["tensors"]
        out.append(
            f"| time ratio ({k:.2f}x the tensors) | | | "
            + " | ".join(f"{hi[op]['median'] / lo[op]['median']:.2f}x" for op in OPS)
            + " |"
        )
        out += [
            "",
            f"Linear costs give a time ratio near {k:.2f}x, quadratic ones near {k * k:.2f}x. "
            f"At {hi['tensors']:,} tensors, info takes {hi['info']['median'] / hi['load']['median']:.1f}x "
            f"and verify {hi['verify']['median'] / hi['load']['median']:.1f}x the time of a load "
            f"(target at most 3x: {'met' if max(hi['info']['median'], hi['verify']['median']) <= 3 * hi['load']['median'] else 'not met'}).",
        ]
    return "\n".join(out + ["", machine_line(res)])


def io(res) -> str:
    out = [
        f"State: {res['state']} + Adam, {res['bytes'] / 2**30:.2f} GiB; CRC32C: {res['crc32c']}.",
        "",
        "| file system | contender | save | save GB/s | load + read every tensor: cold cache | warm cache "
        "| load + write every tensor (warm) | peak RSS above the state (save) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for pl in res["places"]:
        fs = f"{pl['disk']['fs']} ({pl['disk']['device']})"
        for name, c in pl["contenders"].items():
            save = (
                f"{_mm(c['save'], fmt='{:.2f} s')} | {res['bytes'] / c['save']['median'] / 1e9:.2f}"
                if "save" in c
                else "— | —"
            )
            loads = " | ".join(
                _mm(c[f"load_{k}"], fmt="{:.2f} s") if f"load_{k}" in c else "—" for k in ("cold", "warm", "write")
            )
            peak = f"{c['peak_extra']['median'] / 2**20:.0f} MiB" if "peak_extra" in c else "—"
            out.append(f"| {fs} | {name} | {save} | {loads} | {peak} |")
        r = pl["ratios"]
        line = [
            f"- {fs}: save {_mm(r['save_over_raw_write'], fmt='{:.2f}x')} the raw write (target at most 1.1x: "
            f"{'met' if r['save_over_raw_write']['median'] <= 1.1 else 'not met'})."
        ]
        for cache, by in r["load"].items():
            v, m = by["fastai_resume"], by["fastai_resume mmap=True"]
            if cache == "write":
                pw = v.get("safetensors backend=pread")
                line.append(
                    "Load + write every tensor (warm, what a resumed step does to the state it loaded): the "
                    f"verified load {_mm(v['safetensors'], fmt='{:.2f}x')} safetensors' mapped load"
                    + (f", {_mm(pw, fmt='{:.2f}x')} its load into memory of its own" if pw else "")
                    + f" and {_mm(v['torch.save/load(mmap)'], fmt='{:.2f}x')} torch.load(mmap)'s; with mmap=True "
                    f"{_mm(m['safetensors'], fmt='{:.2f}x')} safetensors'."
                )
                continue
            st, tm = v["safetensors"]["median"], m["safetensors"]["median"]
            pread = v.get("safetensors backend=pread")
            fresh = v.get("limit: fresh memory, no file")
            floor = pl["floor"][cache] if "floor" in pl else None
            line.append(
                f"{'Cache cold' if cache == 'cold' else 'Cache warm' if pl['caches'] != ['warm'] else 'Load'}: "
                f"the verified load {_mm(v['safetensors'], fmt='{:.2f}x')} safetensors' (which maps the file) "
                + (
                    f"and {_mm(pread, fmt='{:.2f}x')} safetensors' load into memory of its own (backend=pread), "
                    if pread
                    else ""
                )
                + f"{_mm(v['torch.save/load(mmap)'], fmt='{:.2f}x')} torch.load(mmap)'s (target at most 1.2x "
                f"safetensors': {'met' if st <= 1.2 else 'not met'}); "
                f"{_mm(v['limit: read() into touched memory'], fmt='{:.2f}x')} the read() limit, "
                f"{_mm(v['limit: copy from the page cache'], fmt='{:.2f}x')} the copy limit"
                + (f" and {_mm(fresh, fmt='{:.2f}x')} the fresh-memory limit" if fresh else "")
                + (
                    f" (fresh memory alone, with no file, is {_mm(floor, fmt='{:.2f}x')} safetensors' whole load)"
                    if floor
                    else ""
                )
                + f"; with mmap=True {_mm(m['safetensors'], fmt='{:.2f}x')} safetensors' and "
                f"{_mm(m['torch.save/load(mmap)'], fmt='{:.2f}x')} torch's (target at most 1.1x safetensors': "
                f"{'met' if tm <= 1.1 else 'not met'})."
            )
        if "resident_when_cold" in pl:
            rc = pl["resident_when_cold"]
            line.append(
                f"The cold loads found {100 * rc['median']:.1f}% (at most {100 * rc['max']:.1f}%) of the file in the page cache."
            )
        if "resident_when_warm" in pl:
            rw = pl["resident_when_warm"]
            line.append(f"The warm loads found {100 * rw['min']:.1f}% (at least) of the file in the page cache.")
        notes.append(" ".join(line))
    return "\n".join(out + [""] + notes + ["", machine_line(res)])


def io_summary(res) -> str:
    "The README's table of the I/O benchmark: each load's median in each place, and the targets' ratios."
    cols = []  # (heading, place, cache)
    for pl in res["places"]:
        for cache in pl["caches"]:
            where = pl["disk"]["fs"]
            cols.append((f"read: {where}" if pl["caches"] == ["warm"] else f"read: {where}, {cache} cache", pl, cache))
    for pl in res["places"]:
        if "write" in pl["ratios"]["load"]:
            fs = pl["disk"]["fs"]
            cols.append((f"write: {fs}" if pl["caches"] == ["warm"] else f"write: {fs}, warm cache", pl, "write"))
    rows = [
        ("fastai_resume", "`fastai_resume.load`: verified, memory of its own"),
        ("fastai_resume mmap=True", "`fastai_resume.load(mmap=True)`: verified, zero copy"),
        ("safetensors", "safetensors `load_file`: maps the file, nothing verified"),
        ("safetensors backend=pread", "safetensors `load_file(backend='pread')`: memory of its own, nothing verified"),
        ("torch.save/load(mmap)", "`torch.load(mmap=True)`: maps the file, nothing verified"),
        ("limit: fresh memory, no file", "limit: memory of its own alone, no file read"),
    ]
    out = [
        f"A {res['bytes'] / 2**30:.1f} GiB state ({res['state']} + Adam): load, then read every tensor (read), or "
        "write every tensor once in place as a resumed training step does to its state (write); medians:",
        "",
        "| | " + " | ".join(h for h, _, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for key, label in rows:
        if all(key in pl["contenders"] for _, pl, _ in cols):
            cells = (pl["contenders"][key].get(f"load_{c}") for _, pl, c in cols)
            out.append(f"| {label} | " + " | ".join(f"{x['median']:.2f} s" if x else "—" for x in cells) + " |")

    def ratio(ours, rival, target=None):
        cells = []
        for _, pl, c in cols:
            r = pl["ratios"]["load"][c][ours].get(rival)
            if r is None:
                return
            m = r["median"]
            judged = target is not None and c != "write"  # the targets are the read's
            cells.append(f"{m:.2f}x" + (f" ({'met' if m <= target else 'not met'})" if judged else ""))
        return " | ".join(cells)

    for ours, rival, target, label in (
        ("fastai_resume", "safetensors", 1.2, "verified load / safetensors' (target at most 1.2x, read)"),
        ("fastai_resume", "torch.save/load(mmap)", None, "verified load / torch.load(mmap=True)'s"),
        (
            "fastai_resume",
            "safetensors backend=pread",
            None,
            "verified load / safetensors' load into memory of its own",
        ),
        ("fastai_resume mmap=True", "safetensors", 1.1, "mmap=True / safetensors' (target at most 1.1x, read)"),
    ):
        cells = ratio(ours, rival, target)
        if cells:
            out.append(f"| **{label}** | {cells} |")
    saves = "; ".join(
        f"{pl['disk']['fs']} {pl['contenders']['fastai_resume']['save']['median']:.2f} s, "
        f"{pl['ratios']['save_over_raw_write']['median']:.2f}x the raw write"
        for pl in res["places"]
    )
    return "\n".join(
        out
        + [
            "",
            f"Save, fsynced: {saves} (target at most 1.1x). Every contender, the physical limits and the "
            f"spread over rounds: [docs/benchmarks.md](docs/benchmarks.md).",
            "",
            machine_line(res),
        ]
    )


def resume(res) -> str:
    out = [
        f"An epoch of {res['batches']:,} batches, {res['item_ms']} ms per item; time from `fit` to the first "
        "trained batch, medians (min to max) over the rounds; ratios paired by round.",
        "",
        "| resume at k | fastai_resume | its `learn.load` | seed PR | seed / ours | ours / ours at k=0 |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        load = _mm(r["ours_load_s"], 1e3, "{:.1f} ms") if r["k"] else "—"
        out.append(
            f"| {r['k']:,} ({100 * r['fraction']:.0f}%) | {_mm(r['ours_s'], 1e3, '{:.1f} ms')} | {load} | "
            f"{_mm(r['seed_s'], 1e3, '{:,.0f} ms')} | {_mm(r['seed_over_ours'], fmt='{:,.0f}x')} "
            f"| {_mm(r['ours_over_k0'], fmt='{:.2f}x')} |"
        )
    last = res["rows"][-1]
    k0, fast = last["ours_over_k0"]["median"], last["seed_over_ours"]["median"]
    out += [
        "",
        f"Targets at k = {last['k']:,} (medians): ours within 1.2x of ours at k=0 "
        f"({'met' if k0 <= 1.2 else 'not met'}: {k0:.2f}x) and at least 50x faster than the seed's approach "
        f"({'met' if fast >= 50 else 'not met'}: {fast:,.0f}x).",
    ]
    return "\n".join(out + ["", machine_line(res)])


def _ratio(a, b) -> dict:
    "The ratio of two measurements paired by round, as stats."
    return common.stats([x / y for x, y in zip(a["values"], b["values"])])


def llm(res) -> str:
    b, t, snap = res["bytes"], res["save_s"], res["snapshot_bytes"]
    mb = lambda n: f"{n / 1e6:,.1f} MB"  # noqa: E731
    ms = lambda s: _mm(s, 1e3, "{:,.1f} ms")  # noqa: E731
    x = lambda a, b: _mm(_ratio(a, b), fmt="{:.2f}x")  # noqa: E731
    rows = [
        ("ours (`with_iter=True`: the base by fingerprint)", b["ours"], t["ours"], snap["ours"]),
        ("ours, the base a copy in memory (read at each save)", b["ours"], t["ours unmapped"], snap["ours"]),
        ("ours, `full=True` (every tensor)", b["ours full"], t["ours full"], snap["ours full"]),
        ("Hugging Face Trainer's files (no fsync)", b["trainer"], t["trainer"], None),
        ("Hugging Face Trainer's files, each fsynced", b["trainer"], t["trainer + fsync"], None),
    ]
    out = [
        f"{res['model']}: {mb(b['base'])} of frozen weights, loaded by `from_pretrained` (their pages the "
        "safetensors file's). One checkpoint at a batch boundary of the fit, medians (min to max) over the "
        "rounds, the contenders interleaved; ratios paired by round.",
        "",
        "| checkpoint | bytes | save | a background snapshot holds |",
        "|---|---|---|---|",
    ]
    for name, size, time_s, held in rows:
        out.append(f"| {name} | {mb(size)} | {ms(time_s)} | {mb(held) if held is not None else '—'} |")
    by, tt = b["ours"] / b["trainer"], _ratio(t["ours"], t["trainer"])
    r = res["resume_s"]
    load = r["from_pretrained"]
    pct = lambda s: _mm(_ratio(s, load), 100, "{:.0f}%")  # noqa: E731  (paired by process)
    met = lambda ok: "met" if ok else "not met"  # noqa: E731
    within = lambda s: met(_ratio(s, load)["median"] <= 0.1)  # noqa: E731
    out += [
        "",
        f"Ours against the Trainer's: {by:.2f}x the bytes (target at most 1.5x: {met(by <= 1.5)}), "
        f"{_mm(tt, fmt='{:.2f}x')} the save time without its fsync (target at most 2x: {met(tt['median'] <= 2)}), "
        f"{x(t['ours'], t['trainer + fsync'])} with it. Each save proves the frozen weights unchanged: their pages "
        f"still the file's, read from the kernel's page table, {ms(t['fingerprints'])}; where the base is a copy "
        f"(another dtype, a GPU, anonymous memory) it reads every byte, {ms(t['pass'])}, and the save takes "
        f"{x(t['ours unmapped'], t['trainer'])} the Trainer's. The full file is {b['ours full'] / b['ours']:,.0f}x "
        "the delta's bytes.",
        "",
    ]
    if "bf16 ours" in t:  # the same learner, its base a bf16 copy: anonymous memory, proven by write protection
        bt = _ratio(t["bf16 ours"], t["bf16 trainer"])
        out += [
            f"The base a bf16 copy (`model.to(torch.bfloat16)`, {mb(b['bf16 base'])}: not the file's pages), as a "
            f"bf16 fine-tune holds it: ours {ms(t['bf16 ours'])} against the Trainer's {ms(t['bf16 trainer'])} "
            f"({ms(t['bf16 trainer + fsync'])} fsynced), {_mm(bt, fmt='{:.2f}x')} (target at most 2x: "
            f"{met(bt['median'] <= 2)}); {mb(b['bf16 ours'])} against {mb(b['bf16 trainer'])}. Its fingerprints "
            f"take {ms(t['bf16 fingerprints'])}: the kernel says no page of the base was written since it was "
            f"read (write protection, `unwritten`{'' if b.get('bf16 tracking') else ': not available here'}), "
            f"where reading it takes {ms(t['bf16 pass'])}; with that off, the save takes "
            f"{ms(t['bf16 ours, read'])}, {x(t['bf16 ours, read'], t['bf16 trainer'])} the Trainer's.",
            "",
        ]
    out += [
        f"What a resume adds, in a new process each round (the base just loaded; ratios paired by process), "
        f"against {ms(load)} for the "
        f"base's `from_pretrained` load (target at most 10%): with AutoCheckpoint, the fingerprints its stage "
        f"begins with, which the resumed fit checks the references against, {ms(r['stage'])}, {pct(r['stage'])} "
        f"({within(r['stage'])}); by `learn.load` at the top of the script, that load's check too, "
        f"{ms(r['hand'])}, {pct(r['hand'])} ({within(r['hand'])}). On a machine that never read this base (a lost "
        f"machine's replacement) both read it once: {ms(r['cold stage'])}, {pct(r['cold stage'])}, and "
        f"{ms(r['cold hand'])}, {pct(r['cold hand'])}. A plain load's check (`resume=False`) {ms(r['check'])}; "
        f"the whole `learn.load` of the delta file {ms(r['load'])}.",
        "",
        machine_line(res),
    ]
    return "\n".join(out)


def ddp_control(res) -> str:
    return (
        f"World size {res['world_size']}, {res['iters']:,} calls per round: the agreement takes "
        f"{_mm(res['agree_any_us'], fmt='{:.0f} µs')} per batch, DDP's own gradient all-reduce of the test "
        f"suite's 9,610-parameter MLP {_mm(res['grad_allreduce_us'], fmt='{:.0f} µs')} "
        f"(ratio {_mm(res['ratio'], fmt='{:.2f}x')}).\n\n" + machine_line(res)
    )


def sharded(res) -> str:
    out = []
    for scaling, what in (
        ("same model", "A fixed model, each rank holding 1/N of it"),
        ("same share", "A fixed share per rank, the model growing with N"),
    ):
        out += [
            f"**{what}** (seconds: the slowest rank, median and range of {res['rounds']} rounds):",
            "",
            "| processes | model + Adam | rank 0's file | save: fastai_resume | save: DCP | load: fastai_resume "
            "| load: DCP |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in res["rows"] if r["scaling"] == scaling):
            out.append(
                f"| {r['world']} | {r['state_bytes'] / 2**20:.0f} MiB | {r['file_bytes_rank0'] / 2**20:.1f} MiB "
                f"| {_mm(r['ours_save'])} | {_mm(r['dcp_save'])} | {_mm(r['ours_load'])} | {_mm(r['dcp_load'])} |"
            )
        out.append("")
    return "\n".join(out + [machine_line(res)])


def streams(res) -> str:
    out = [
        f"A Hugging Face `datasets` stream of {res['rows_per_epoch']:,} rows ({res['seq']} token ids each) in batches "
        f"of {res['bs']}, resumed by a new process with `learn.load`: seconds from `fit` to the first trained batch, "
        "medians (min to max) over the rounds; ratios paired by round. The replay's cost is the time it adds to the "
        "start at 0%, against the time to train the batches it skips: at this benchmark's small model's step "
        f"({_mm(res['small_step_s'], 1e3, '{:.2f} ms')}) and a GPT-2-shaped model's (4 layers, 256 wide: "
        f"{_mm(res['llm_step_s'], 1e3, '{:.0f} ms')} a step).",
        "",
        "| stream | resumed at | start | / start at 0% | replay / its training (small model) | (GPT-2-shaped) |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        rep = r.get("replay_over_training")
        out.append(
            f"| {r['stream']} | {100 * r['fraction']:.0f}% ({r['k']:,} batches) | "
            f"{_mm(r['start_s'], 1e3, '{:,.0f} ms')} | {_mm(r['over_start_at_0'], fmt='{:.2f}x')} | "
            + (
                f"{_mm(rep, 100, '{:.1f}%')} | {_mm(r['replay_over_llm_training'], 100, '{:.2f}%')} |"
                if rep
                else "— | — |"
            )
        )
    held = [r for r in res["results"] if "replay_over_training" not in r and r["fraction"]]
    rep = [r for r in res["results"] if "replay_over_training" in r]
    worst_held = max(r["over_start_at_0"]["median"] for r in held)
    worst_small = max(r["replay_over_training"]["median"] for r in rep)
    worst_llm = max(r["replay_over_llm_training"]["median"] for r in rep)
    out += [
        "",
        f"Targets (medians): where the state is held, at most 1.2x the start at 0% "
        f"({'met' if worst_held <= 1.2 else 'not met'}: {worst_held:.2f}x at worst); where the epoch is replayed, "
        f"at most 5% of the training time it saves ({'met' if worst_llm <= 0.05 else 'not met'} at the "
        f"GPT-2-shaped model's step: {100 * worst_llm:.2f}% at worst; "
        f"{'met' if worst_small <= 0.05 else 'not met'} at the small model's: {100 * worst_small:.1f}%).",
    ]
    return "\n".join(out + ["", machine_line(res)])


def everystep(res) -> str:
    "A checkpoint at every step of a LoRA fine-tune: each way's mean step and what it adds, paired by round."
    step, added = res["step_s"], res["added_pct"]
    labels = {
        "none": "no checkpoint",
        "every 1": "`AutoCheckpoint(every_iters=1)` (default: `background='auto'`, published by a thread)",
        "every 1 sync": "`every_iters=1, background=False`",
        "every 10": "`AutoCheckpoint(every_iters=10)` (default)",
        "every 10 sync": "`every_iters=10, background=False`",
    }
    out = [
        f"{res['model']}, loaded by `from_pretrained`, fastai `fit`: the mean step over {res['steps']} steps "
        f"(the first {res['warmup']} left out), each way in a new process, the ways interleaved; medians "
        "(min to max) over the rounds, what each adds paired by round with the same round's run without.",
        "",
        "| checkpoints | mean step | added to the step | AutoCheckpoint's time at the boundary, a step |",
        "|---|---|---|---|",
    ]
    stall, stall_pct = res.get("stall_s", {}), res.get("stall_pct", {})
    for k, v in step.items():
        add = _mm(added[k], fmt="{:+.1f}%") if k in added else "—"
        own = f"{_mm(stall[k], 1e3, '{:.2f} ms')}, {stall_pct[k]['median']:.2f}%" if k in stall else "—"
        out.append(f"| {labels.get(k, k)} | {_mm(v, 1e3, '{:.1f} ms')} | {add} | {own} |")
    if "every 1" in added:
        m = added["every 1"]["median"]
        own = stall_pct.get("every 1", {}).get("median")
        met = m <= 1 and own is not None and own <= 1  # (the save's own time: what the mean's noise can hide)
        out += [
            "",
            f"Target at every step: at most 1% added ({'met' if met else 'not met'}: {m:+.1f}% paired by round"
            + (f"; the save's own time at the boundary {own:.2f}% of the step" if own is not None else "")
            + ").",
        ]
    return "\n".join(out + ["", machine_line(res)])


def fsdp_lora(res) -> str:
    "A sharded LoRA fine-tune's checkpoint: rank 0's bytes and the slowest rank's save, against full and DCP."
    t, b, share = res["save_s"], res["bytes_rank0"], res["trainable_and_opt_share"]
    labels = {
        "ours": "`learn.save(name)`: what trains, the base by fingerprint",
        "ours_full": "`learn.save(name, full=True)`: every tensor",
        "dcp": "DCP `dcp.save` of the trainable and optimizer state",
    }
    out = [
        f"{res['model']} (the base {res['base_bytes'] / 2**20:.0f} MiB), loaded by `from_pretrained`, LoRA r=8 on "
        f"`c_attn`, {res['world']} ranks (gloo) in `fsdp_ctx`; the trainable and optimizer state's share of rank 0: "
        f"{share / 2**20:.2f} MiB. Save: the slowest rank's, median (min to max) over the rounds; bytes: rank 0's files.",
        "",
        "| save | rank 0's bytes | x the trainable and optimizer share | save time | x DCP's |",
        "|---|---|---|---|---|",
    ]
    for k in ("ours", "ours_full", "dcp"):
        out.append(
            f"| {labels[k]} | {b[k] / 2**20:.2f} MiB | {b[k] / share:.2f}x | {_mm(t[k], 1e3, '{:.0f} ms')} | "
            f"{t[k]['median'] / t['dcp']['median']:.2f}x |"
        )
    bytes_x, time_x = b["ours"] / share, t["ours"]["median"] / t["dcp"]["median"]
    out += [
        "",
        f"Targets: bytes at most 1.5x the share ({'met' if bytes_x <= 1.5 else 'not met'}: {bytes_x:.2f}x), save at "
        f"most 2x DCP's ({'met' if time_x <= 2 else 'not met'}: {time_x:.2f}x); the full checkpoint is "
        f"{b['ours_full'] / b['ours']:.0f}x ours.",
    ]
    return "\n".join(out + ["", machine_line(res)])


def everystep_summary(res) -> str:
    "The README's line of the every-step benchmark: the save's own time first (what the machine's noise does not blur)."
    step, added, own = res["step_s"], res["added_pct"], res.get("stall_pct", {})
    ks = [k for k in ("every 1", "every 10") if k in added and k in own]
    at = " and ".join(f"{own[k]['median']:.1f}% at N={k.split()[1]}" for k in ks)
    paired = " and ".join(_mm(added[k], fmt="{:+.1f}%") for k in ks)
    met = "met" if "every 1" in own and own["every 1"]["median"] <= 1 else "not met"
    return (
        f"A LoRA fine-tune ({res['model']}, {1e3 * step['none']['median']:.0f} ms a step on "
        f"{res['machine']['cores']} CPU cores) checkpointed by `AutoCheckpoint(every_iters=N)`: the save's own time "
        f"at the batch's end is {at} of the step (target at every step at most 1%: {met}); the mean step, paired by "
        f"round with a run without, {paired}: this shared machine's noise ([docs/finetuning.md](docs/finetuning.md))."
    )


RENDER = {
    "io": io,
    "resume": resume,
    "overhead": overhead,
    "scale": scale,
    "ddp_control": ddp_control,
    "sharded": sharded,
    "llm": llm,
    "streams": streams,
    "everystep": everystep,
    "fsdp_lora": fsdp_lora,
}
# Benchmarks whose block is in a page of docs/ rather than in the README (which links to the page).
PAGES = {
    "sharded": os.path.join(HERE, "..", "docs", "sharded.md"),
    "llm": os.path.join(HERE, "..", "docs", "finetuning.md"),
    "streams": os.path.join(HERE, "..", "docs", "streams.md"),
    "everystep": os.path.join(HERE, "..", "docs", "finetuning.md"),
    "fsdp_lora": os.path.join(HERE, "..", "docs", "finetuning.md"),
}
# Summaries in the project's README.md of a benchmark whose whole table is on the benchmarks page:
# block name -> (the benchmark whose result file it reads, its renderer).
MAIN_README = os.path.join(HERE, "..", "README.md")
SUMMARIES = {"io-summary": ("io", io_summary), "everystep-summary": ("everystep", everystep_summary)}


def _source(name: str) -> str:
    "The benchmark whose result file block `name` shows (a summary's, or its own)."
    return SUMMARIES[name][0] if name in SUMMARIES else name


def render_file(name: str, path: str) -> str:
    "Block `name`'s figures as Markdown, from its benchmark's JSON file at `path`."
    with open(path) as f:
        res = json.load(f)
    return (SUMMARIES[name][1] if name in SUMMARIES else RENDER[name])(res).rstrip("\n") + "\n"


def publish(name: str, payload: dict, path=None) -> str:
    "A benchmark's end: its figures written (`common.write`), printed as Markdown, and where they went."
    path = common.write(name, payload, path)
    print(render_file(name, path))
    print(f"\nwrote {path}")
    return path


def render(name: str, results=RESULTS) -> str:
    return render_file(name, os.path.join(results, f"{_source(name)}.json"))


def rewrite(text: str, results=RESULTS) -> str:
    "`text` with every bench block replaced by what its JSON file gives."
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("name"), results) + m.group(4), text)


def problems(text: str, results=RESULTS, names=None) -> list:
    """What is wrong with the README's bench blocks (or a page's: `names`, the blocks it must have):
    missing, unknown, or not what the files give."""
    names = [n for n in RENDER if n not in PAGES] if names is None else names
    found = [m.group("name") for m in BLOCK.finditer(text)]
    known = set(RENDER) | set(SUMMARIES)
    out = [
        f"no block <!-- bench:{n} --> for bench/results/{_source(n)}.json"
        for n in names
        if os.path.exists(os.path.join(results, f"{_source(n)}.json")) and n not in found
    ]
    out += [f"block bench:{n} has no renderer" for n in found if n not in known]
    for m in BLOCK.finditer(text):
        n = m.group("name")
        if n in known and m.group("body") != render(n, results):
            out.append(f"block bench:{n} differs from bench/results/{_source(n)}.json (run python bench/report.py)")
    return out


def _figures(v, path=""):
    "Every (path, statistics) of a result: the dicts with a median, min and max."
    if isinstance(v, dict):
        if {"median", "min", "max"} <= v.keys():
            yield path, v
            return
        for k, x in v.items():
            if k != "machine":
                yield from _figures(x, f"{path}.{k}" if path else str(k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _figures(x, f"{path}[{i}]")


def reproduced(old_dir: str, new_dir: str = RESULTS) -> tuple:
    """Which figures of the results in `old_dir` (the README's) a later run in `new_dir` reproduces:
    its median inside the old run's min-max. Returns (reproduced, not reproduced) as lists of lines."""
    yes, no = [], []
    for name in RENDER:
        a, b = (os.path.join(d, f"{name}.json") for d in (old_dir, new_dir))
        if not (os.path.exists(a) and os.path.exists(b)):
            continue
        with open(a) as f, open(b) as g:
            old, new = dict(_figures(json.load(f))), dict(_figures(json.load(g)))
        for path, s in old.items():
            if path not in new or path.endswith(".values"):
                continue
            m = new[path]["median"]
            line = f"{name}: {path}: {m:.4g} against {s['median']:.4g} ({s['min']:.4g} to {s['max']:.4g})"
            (yes if s["min"] <= m <= s["max"] else no).append(line)
    return yes, no


def _pool(docs):
    "One result from the same benchmark's results of several runs: every figure's rounds pooled."
    first = docs[0]
    if isinstance(first, dict) and {"median", "min", "max", "values"} <= first.keys():
        return common.stats([v for d in docs for v in d["values"]])
    if isinstance(first, dict):
        return {k: _pool([d[k] for d in docs]) if all(k in d for d in docs) else v for k, v in first.items()}
    if isinstance(first, list) and all(isinstance(d, list) and len(d) == len(first) for d in docs):
        return [_pool([d[i] for d in docs]) for i in range(len(first))]
    if isinstance(first, float):
        return statistics.median(docs)  # a derived figure (an interval's seconds): the runs' median
    return first


def merge(dirs, out=RESULTS) -> list:
    """Pool the rounds of several `make bench` runs (each a folder of result files) into `out`: every
    figure's values concatenated and its median and range taken anew; the machine record lists the runs'
    dates. Returns the names written."""
    written = []
    for name in RENDER:
        files = [os.path.join(d, f"{name}.json") for d in dirs if os.path.exists(os.path.join(d, f"{name}.json"))]
        if not files:
            continue
        docs = []
        for f in files:
            with open(f) as fh:
                docs.append(json.load(fh))
        res = _pool([{k: v for k, v in d.items() if k not in ("machine", "rounds")} for d in docs])
        runs = [r for d in docs for r in d["machine"].get("runs", [d["machine"]["date"]])]
        res["machine"] = dict(docs[-1]["machine"], runs=runs)
        res["rounds"] = sum(d["rounds"] for d in docs)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as fh:
            json.dump(res, fh, indent=1)
        written.append(name)
    return written


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--readme", default=README)
    ap.add_argument(
        "--reproduces",
        metavar="OLD_DIR",
        help="say which figures of the results in OLD_DIR the files in bench/results/ reproduce",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="pool the rounds of the runs whose result files are in DIR ... into bench/results/",
    )
    a = ap.parse_args()
    if a.merge:
        names = merge(a.merge)
        print(f"pooled {len(a.merge)} runs into bench/results/: {', '.join(names)}")
        return
    if a.reproduces:
        yes, no = reproduced(a.reproduces)
        print("\n".join(["not reproduced (median outside the old range):"] + no))
        print(f"{len(yes)} of {len(yes) + len(no)} figures reproduced within the old run's range")
        return
    docs = [(a.readme, None)] + [(page, [name]) for name, page in PAGES.items()] + [(MAIN_README, list(SUMMARIES))]
    bad = []
    for doc, names in docs:
        with open(doc) as f:
            text = f.read()
        if a.check:
            bad += problems(text, names=names)
            continue
        new = rewrite(text)
        if new != text:
            with open(doc, "w") as f:
                f.write(new)
        print(f"{os.path.relpath(doc)}: {len(BLOCK.findall(new))} benchmark blocks written from bench/results/")
    for p in bad:
        print(p, file=sys.stderr)
    if a.check:
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
