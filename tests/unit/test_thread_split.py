"""benchmarks/thread_split.py: perf script samples counted per thread and shared object."""

from __future__ import annotations

import json

import pytest

from benchmarks.thread_split import KERNELS, main, parse, split

# `perf script -F tid,time,ip,sym,dso` with call graphs: a header line, then frames.
WITH_CALLCHAINS = """\
 100 10.000:
\t    7f00aa column_tile+0x1c (/root/.cache/treadle/kernels/kernels-avx512bf16-abc.so)
\t    7f00ab thread_share+0x10 (/root/.cache/treadle/kernels/kernels-avx512bf16-abc.so)

 101 10.001:
\t    7f00cc [unknown] (/usr/lib/libgomp.so.1)

 100 11.000:
\t    5f00dd _PyEval_EvalFrameDefault+0x5 (/usr/lib/libpython3.11.so.1.0)
\t    5f00de main (/usr/bin/python3.11)

 101 11.500:
\t    7f00aa item_1_64_3+0x2 (/root/.cache/treadle/kernels/kernels-avx2-def.so)

"""

# Without call graphs every sample is one line.
FLAT = """\
 100 10.000:   ffffffff8100 clear_page_erms ([kernel.kallsyms])
 100 10.001:   7f00aa column_tile+0x1c (/tmp/kernels-avx512bf16-abc.so)
 101 10.002:   7f00cc [unknown] (/usr/lib/libgomp.so.1)
"""


def test_parse_takes_each_samples_first_frame():
    samples = parse(WITH_CALLCHAINS)
    assert [(s.tid, s.time, s.symbol, s.dso) for s in samples] == [
        (100, 10.0, "column_tile", KERNELS),
        (101, 10.001, "[unknown]", "libgomp.so.1"),
        (100, 11.0, "_PyEval_EvalFrameDefault", "libpython3.11.so.1.0"),
        (101, 11.5, "item_1_64_3", KERNELS),
    ]


def test_parse_reads_flat_output():
    samples = parse(FLAT)
    assert [(s.tid, s.symbol, s.dso) for s in samples] == [
        (100, "clear_page_erms", "[kernel.kallsyms]"),
        (100, "column_tile", KERNELS),
        (101, "[unknown]", "libgomp.so.1"),
    ]


def test_split_converts_samples_to_seconds_per_thread():
    result = split(parse(WITH_CALLCHAINS), frequency=2.0)
    assert result["span_seconds"] == pytest.approx(1.5)
    assert list(result["threads"]) == [100, 101]
    assert result["threads"][100]["by_dso"] == {KERNELS: 0.5, "libpython3.11.so.1.0": 0.5}
    assert result["threads"][101]["seconds"] == 1.0
    assert result["threads"][101]["top_kernels"] == {"item_1_64_3": 0.5}


def test_last_seconds_keeps_the_end_of_the_recording():
    result = split(parse(WITH_CALLCHAINS), frequency=1.0, last_seconds=0.6)
    # only the samples at 11.0 and 11.5 are within 0.6 s of the last one
    assert {tid: t["by_dso"] for tid, t in result["threads"].items()} == {
        100: {"libpython3.11.so.1.0": 1.0}, 101: {KERNELS: 1.0}}


def test_bad_frequency_is_refused():
    with pytest.raises(ValueError, match="frequency"):
        split(parse(FLAT), frequency=0)


def test_main_prints_json(tmp_path, capsys):
    path = tmp_path / "run.txt"
    path.write_text(FLAT)
    main([str(path), "--frequency", "1000", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["threads"]["100"]["by_dso"] == {"[kernel.kallsyms]": 0.001, KERNELS: 0.001}
