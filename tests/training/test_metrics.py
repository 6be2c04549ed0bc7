"""--metrics-file (training/metrics.py) under Megatron-LM's trainer. A folder the launch script
never made stopped the last rank alone with a FileNotFoundError traceback after the first
iteration (a helper's soak; the other ranks then reported a lost peer): the folder is made
now, and a path that cannot be written stops every rank at start-up with one line."""

import os

import pytest

from tests.training.megatron_lm_checkout import import_megatron_lm
from tests.training.runs import error_lines, flags, metrics_records, run_ranks, start, start_each

pytestmark = pytest.mark.timeout(240)


def test_a_metrics_file_in_a_new_folder_is_written(short_docs_data, tmp_path):
    import_megatron_lm()
    path = tmp_path / "runs" / "today" / "metrics.jsonl"
    results = run_ranks(start, 2, flags(short_docs_data, path, "--train-iters", "2"),
                        timeout=240, daemon=False)
    assert [code for code, _ in results] == [0, 0], results
    assert [r["iteration"] for r in metrics_records(path) if "kind" not in r] == [1, 2]


def test_a_metrics_file_that_cannot_be_written_stops_every_rank(short_docs_data, tmp_path):
    import_megatron_lm()
    (tmp_path / "run").write_text("a file where the folder should be")
    path = tmp_path / "run" / "metrics.jsonl"
    results = run_ranks(start, 2, flags(short_docs_data, path), timeout=240, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    assert error_lines(results) == [[
        f"pretrain_gpt.py: error: --metrics-file {path}: cannot be written (File exists: "
        f"{tmp_path / 'run'})"]] * 2, results
    assert "Traceback" not in results[0][1]


def test_the_flag_given_to_the_last_rank_only(short_docs_data, tmp_path):
    """Log destinations may differ by rank (same_flags), and a script may give the flag to
    its writer only: the first version's check was a collective on the ranks with the flag
    alone (the others went on into the next group's creation: a wait to the timeout)."""
    import_megatron_lm()
    path = str(tmp_path / "new" / "m.jsonl")
    argv = flags(short_docs_data, None, "--train-iters", "2")
    results = run_ranks(start_each, 2, [argv, argv + ["--metrics-file", path]], timeout=240,
                        daemon=False)
    assert [code for code, _ in results] == [0, 0], results
    assert os.path.getsize(path) > 0


def test_eod_flops_is_megatron_lms_formula_at_the_documents_pairs(monkeypatch):
    """Megatron-LM's own num_floating_point_operations (its real parser's args for a GQA
    SwiGLU GPT): given batch x seq-length^2 it is the causal count; the documents' sum of
    length^2 lowers only its attention part; and for the Megatron-LMs without its
    seqlen_squared_sum argument (0.16, 0.17) the attention part measured from two calls at
    the same tokens gives the same count."""
    from megatron.training.training import num_floating_point_operations as flops

    from megatron_eod.training.metrics import eod_flops
    from tests.training.test_run import validated

    args = validated(monkeypatch, "--swiglu", "--group-query-attention", "--num-query-groups",
                     "2", "--ffn-hidden-size", "96")
    args.padded_vocab_size = 384  # set by Megatron-LM's tokenizer build
    batch, seq = 8, args.seq_length
    causal = flops(args, batch)
    assert eod_flops(flops, args, batch, batch * seq * seq, batch * seq) == causal
    documents = batch * (3 * 40 * 40 + 8 * 8)  # each row: 3 documents of 40, one of 8
    eod = eod_flops(flops, args, batch, documents, batch * seq)
    no_attention = eod_flops(flops, args, batch, 0, batch * seq)
    assert no_attention < eod < causal
    assert (eod - no_attention) / (causal - no_attention) == pytest.approx(
        documents / (batch * seq * seq), rel=1e-12)

    def without_the_argument(args, batch_size):  # megatron-core <= 0.17's signature
        return flops(args, batch_size)

    assert eod_flops(without_the_argument, args, batch, documents, batch * seq) == \
        pytest.approx(eod, rel=1e-12)
