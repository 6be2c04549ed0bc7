"""The tiny GPT (tests/training/runs.py) through Megatron-LM's REAL `pretrain()` on gloo ranks:
every data source Megatron-LM reads, its evaluations (several validation sets, micro-batches
of their own), a run that ends where its data ends, and a data error as one line on every
rank."""

import json
import re

import pytest

from megatron_eod.data.preprocess import preprocess_jsonl
from megatron_eod.data.tokenizers import ByteTokenizer
from tests.training.megatron_lm_checkout import (import_megatron_lm, megatron_lm_knows,
                                                 null_tokenizer_vocab_size)
from tests.training.runs import (EVALUATE, ITERS, flags, metrics_records, run_ranks, start,
                                 train)

pytestmark = pytest.mark.timeout(300)


def test_every_data_source_megatron_lm_reads(baseline, short_docs_data, tmp_path):
    """Megatron-LM's other data sources mean what they mean there (its own
    get_blend_and_blend_per_split): --data-args-path (the blend in a file) trains exactly as
    --data-path; a blend per split (--train/--valid/--test-data-path, or the same in
    --per-split-data-args-path) trains on the whole train blend, as --data-path with
    --split 100,0,0 does, and evaluates on its own valid and test blends."""
    blend_file = tmp_path / "blend.txt"
    blend_file.write_text(f"{short_docs_data}\n")
    losses, _ = train(tmp_path, "args_file", short_docs_data, "--data-args-path", str(blend_file),
                      drop=("--data-path",))
    assert losses == pytest.approx(baseline[0], rel=1e-6)
    whole, _ = train(tmp_path, "whole", short_docs_data, "--split", "100,0,0")
    data = short_docs_data
    per_split, log = train(tmp_path, "per_split", data, "--train-data-path", data,
                           "--valid-data-path", data, "--test-data-path", data,
                           "--no-mmap-bin-files", *EVALUATE, drop=("--data-path", "--split"))
    assert per_split == pytest.approx(whole, rel=1e-6)
    assert set(json.loads(log.splitlines()[-1])) == {"valid", "test"}
    spec = tmp_path / "splits.json"
    spec.write_text(json.dumps({"train": [data], "valid": [data], "test": [data]}))
    from_file, _ = train(tmp_path, "spec", data, "--per-split-data-args-path", str(spec),
                         drop=("--data-path", "--split"))
    assert from_file == pytest.approx(whole, rel=1e-6)


def test_multiple_validation_sets(short_docs_data, tmp_path):
    """--multiple-validation-sets (with --full-validation, which Megatron-LM requires): a
    validation blend of two prefixes is evaluated as two sets, each whole, and
    --metrics-file records each set's loss (the same data twice here: equal losses)."""
    small = str(tmp_path / "small")  # whole validation sets: keep them to a few batches
    with open(small + ".jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"text": f"document {i}: " + "some text to validate on " * 8})
                    + "\n")
    preprocess_jsonl(small + ".jsonl", small, ByteTokenizer(), append_eod=True,
                     log=lambda message: None)
    small += "_text_document"
    losses, log = train(tmp_path, "multi", short_docs_data, "--train-data-path", short_docs_data,
                        "--valid-data-path", small, small, "--multiple-validation-sets",
                        "--full-validation", *EVALUATE, drop=("--data-path", "--split"))
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert "validation-0 loss at iteration 4" in log and "validation-1 loss at iteration 4" in log
    sets = [r for r in metrics_records(tmp_path / "multi.jsonl") if r.get("kind") == "valid"]
    assert [(r["iteration"], r["set"]) for r in sets] == [(ITERS, 0), (ITERS, 1)]
    assert sets[0]["lm_loss"] == pytest.approx(sets[1]["lm_loss"], rel=1e-6)


def test_evaluation_in_micro_batches_of_its_own(short_docs_data, tmp_path):
    """Megatron-LM >= 0.18 reads validation and test data in --eval-micro-batch-size rows. At
    PP=2 x CP=2 (the stage tensors packed for the evaluation's rows, the plans made for them,
    TP-less peers told their size), evaluating 4 sequences a micro-batch gives the validation
    and test losses of evaluating 2, and training is untouched."""
    if not megatron_lm_knows("--eval-micro-batch-size"):
        pytest.skip("this Megatron-LM has no --eval-micro-batch-size (from 0.18)")
    common = ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
              "--eval-iters", "2"]
    reference, reference_log = train(tmp_path, "eval2", short_docs_data, *common)
    losses, log = train(tmp_path, "eval4", short_docs_data, *common, "--eval-micro-batch-size", "4")
    assert losses == pytest.approx(reference, rel=1e-6)
    expected = json.loads(reference_log.splitlines()[-1])
    evaluations = json.loads(log.splitlines()[-1])
    assert set(evaluations) == set(expected) == {"valid", "test"}
    for kind in expected:
        assert evaluations[kind]["lm_loss"] == pytest.approx(expected[kind]["lm_loss"],
                                                             rel=1e-5), kind


def test_a_run_that_ends_where_its_data_ends_finishes(short_docs_data, tmp_path):
    """A weighted blend has exactly the samples the run asks for, so reading one micro-batch
    ahead (plan-ahead) reads past its end on the last step: that read's error counts only if
    the step asks for it (it crashed the last iteration). TP=2: the peer learns of the failed
    read from the source's header."""
    losses, _ = train(tmp_path, "exact", short_docs_data, "--data-path", "0.3", short_docs_data,
                      "0.7", short_docs_data, "--tensor-model-parallel-size", "2",
                      "--make-vocab-size-divisible-by", "64", "--rerun-mode", "disabled",
                      drop=("--data-path",))
    assert sorted(losses) == list(range(1, ITERS + 1))


def test_a_data_error_is_one_line_on_every_rank(short_docs_data, tmp_path):
    """The start-up data checks end the run as the flag errors do (exit 2, `pretrain_gpt.py:
    error:` on every rank), not with a traceback per rank."""
    import_megatron_lm()
    argv = flags(short_docs_data, tmp_path / "m.jsonl")
    argv[argv.index("--vocab-size") + 1] = "300"  # the data's EoD is 256
    results = run_ranks(start, 2, argv, timeout=240, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    for _, text in results:
        assert "pretrain_gpt.py: error: " in text and "EoD id 256" in text, text[-2000:]
        assert "Traceback" not in text and "_text_document.json" in text
    # It names the --vocab-size that gives NullTokenizer the data's EoD id (the flag's value up
    # to megatron-core 0.17, the value - 1 from 0.18).
    hint = re.search(r"train with --tokenizer-type NullTokenizer --vocab-size (\d+)$",
                     results[0][1], re.M)
    assert hint and int(hint.group(1)) == null_tokenizer_vocab_size(256), results[0][1]
