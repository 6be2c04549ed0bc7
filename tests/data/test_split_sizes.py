"""data/split_sizes.py: a split the run draws samples from, empty in some dataset of the
blend, is named at start-up (megatron-core's GPTDataset would search for its tokens forever)."""

import json

import pytest

from megatron_eod.data.checks import DatasetError
from megatron_eod.data.preprocess import preprocess_jsonl
from megatron_eod.data.split_sizes import check_split_sizes, split_shares
from megatron_eod.data.tokenizers import ByteTokenizer


def dataset(tmp_path, name, documents):
    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 5}) + "\n"
                              for i in range(documents)))
    preprocess_jsonl(str(corpus), str(tmp_path / name), ByteTokenizer(), append_eod=True,
                     log=lambda msg: None)
    return str(tmp_path / f"{name}_text_document")


def test_an_empty_split_asked_for_samples_is_named(tmp_path):
    small, large = dataset(tmp_path, "small", 100), dataset(tmp_path, "large", 2000)
    # 969,30,1: the test share of 100 sequences rounds to none, of 2000 to 2.
    with pytest.raises(DatasetError, match=r"small_text_document: its test share of --split "
                                           r"969,30,1 \(0\.001\) holds none of its 100"):
        check_split_sizes(([large, small], [0.9, 0.1]), "969,30,1", [400, 40, 8])
    # megatron-core builds (and searches) the split even asked for 0 samples, or weighted 0.
    for blend, sizes in ((([large, small], [0.9, 0.1]), [400, 40, 0]),
                         (([large, small], [1.0, 0.0]), [400, 40, 8]),
                         (([small], None), [400, 0, 0])):
        with pytest.raises(DatasetError, match="or none at all \\(--split N,N,0\\)"):
            check_split_sizes(blend, "969,30,1", sizes)
    check_split_sizes(([large, small], [0.9, 0.1]), "969,30,1", [400, 40, None])  # whole split
    check_split_sizes(([large], None), "969,30,1", [400, 40, 8])
    check_split_sizes(([small], None), "90,8,2", [400, 40, 8])
    check_split_sizes(([small], None), "100,0,0", [400, 40, 8])  # no share: no such split
    check_split_sizes(None, "969,30,1", [400, 40, 8])  # mock data
    with pytest.raises(DatasetError, match="validation share"):
        check_split_sizes(([dataset(tmp_path, "tiny", 8)], None), "98,1,1", [8, 8, 8])


@pytest.mark.parametrize("split,shares", [
    ("969, 30, 1", [0.969, 0.03, 0.001]), ("90/10", [0.9, 0.1, 0.0]), ("1", [1.0, 0.0, 0.0]),
    ("0,0,5", [0.0, 0.0, 1.0]), ("0.5,0.5", [0.5, 0.5, 0.0])])
def test_split_shares_read_as_megatron_core_reads_them(split, shares):
    assert split_shares(split) == pytest.approx(shares)


@pytest.mark.parametrize("split", ["90,5,3,2", "0,0,0", "", "abc", "1.2.3"])
def test_a_split_megatron_core_cannot_read_is_named(tmp_path, split):
    """megatron-core asserted bare (four numbers) or divided by zero (all 0: a NaN error)."""
    with pytest.raises(ValueError, match=f"--split {split}: give up to three shares"):
        split_shares(split)
    with pytest.raises(DatasetError, match=f"--split {split}: give up to three shares"):
        check_split_sizes(([dataset(tmp_path, "any", 10)], None), split, [8, 8, 8])


def test_the_trainer_stops_at_start_up_instead_of_spinning(tmp_path):
    from tests.harness import run_ranks
    from tests.training.megatron_lm_checkout import import_megatron_lm
    from tests.training.runs import flags, start

    import_megatron_lm()
    small = dataset(tmp_path, "small", 100)
    (code, message), = run_ranks(start, 1, flags(small, None, "--split", "969,30,1"),
                                 timeout=120, daemon=False)
    assert code == 2 and "holds none of its 100 sequences" in message, message
