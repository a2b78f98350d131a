"""Benchmarks draw token ids from the model's own vocabulary and fail loudly when their
requests fail; `treadle bench soak` runs its mixed traffic against a real server.

Before: `bench throughput --model M` on a 1,024-id model ended all its requests in errors,
reported 0 output tok/s and exited 0; `bench static` died with IndexError."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny_checkpoint
from server_fixtures import running_server
from treadle.cli import main

VOCAB = 1024


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v1024"), "llama", vocab_size=VOCAB)


def read(path):
    return json.loads(path.read_text())


def test_bench_throughput_uses_the_models_vocabulary(small_vocab_model, tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", "--model", small_vocab_model, "--dtype", "float32",
            "--num-requests", "4", "--num-kv-blocks", "128", "--output", str(out)]
    assert main(argv) == 0
    result = read(out)
    assert result["num_errors"] == 0 and result["output_tokens_per_s"] > 0
    assert result["output_tokens"] == result["expected_output_tokens"]
    # Ids from another vocabulary: every request fails, and the command says so.
    assert main(argv + ["--vocab-size", "49152"]) == 1
    err = capsys.readouterr().err
    assert "4 of 4 throughput requests failed" in err and "vocabulary" in err


def test_bench_static_uses_the_models_vocabulary(small_vocab_model, tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = ["bench", "static", "--model", small_vocab_model, "--dtype", "float32",
            "--num-requests", "2", "--batch-size", "2", "--output", str(out)]
    assert main(argv) == 0
    assert read(out)["useful_output_tokens"] > 0
    assert main(argv + ["--vocab-size", "49152"]) == 2  # a clear error, not an IndexError
    assert "outside the model's vocabulary [0, 1024)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def keyed_server(small_vocab_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text("- {key: ka, tenant: a}\n- {key: kb, tenant: b}\n")
    with running_server(small_vocab_model, "--num-kv-blocks", "64", "--max-num-seqs", "4",
                        "--api-keys-file", str(keys), "--scheduling-policy", "priority") \
            as (base, _):
        yield base


def test_bench_serve_uses_the_servers_vocabulary(keyed_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--url", keyed_server, "--api-key", "ka", "--num-requests", "3",
            "--max-model-len", "128", "--output", str(out)]
    assert main(argv) == 0
    assert read(out)["num_failed"] == 0 and read(out)["workload"]["vocab_size"] == VOCAB
    assert main(argv + ["--vocab-size", "49152"]) == 1
    assert "3 of 3 serve requests failed" in capsys.readouterr().err


def test_soak_reports_and_accounts_for_every_request(keyed_server, tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--url", keyed_server, "--api-key", "ka", "--api-key", "kb",
                 "--rate", "4", "--duration", "4", "--max-in-flight", "6", "--timeout", "8",
                 "--disconnect-fraction", "0.4", "--prompt-len", "8", "32",
                 "--output-len", "4", "24", "--report-interval", "2", "--workload-seed", "3",
                 "--output", str(out)]) == 0
    result = read(out)
    summary, records = result["summary"], result["requests"]
    assert len(records) == summary["num_requests"] > 5
    statuses = {r["status"] for r in records}
    assert statuses <= {"finished", "disconnected", "timed_out"}
    assert summary["finished"] + summary["disconnected"] + summary["timed_out"] == len(records)
    assert {r["tenant"] for r in records} == {0, 1} and {r["priority"] for r in records} <= \
        {-5, 0, 5}
    leavers = [r for r in records if r["disconnect_after"] is not None]
    assert leavers and all(r["status"] in ("disconnected", "timed_out") for r in leavers)
    good = summary["goodput"]
    assert good["num_good"] == sum(1 for r in records if r["status"] == "finished")
    assert good["of_staying_clients"] == len(records) - len(leavers)
    assert result["reports"] and all(r["rss_mib"] > 0 for r in result["reports"])
    assert summary["server"]["requests_ended"] == len(records)  # every one, aborts too
    assert summary["server"]["preemptions_per_request"] is not None
    printed = capsys.readouterr().out
    assert "rss" in printed and "waiting" in printed and "clients: arrived" in printed
