"""The trainer refuses a dataset that does not fit its tokenizer before the first step, on
every rank, with the file and the rule (exit 2), instead of training with the wrong EoD id."""

import re

from megatron_eod.data import NullTokenizer
from tests.functional.tiny_gpt import tiny_flags
from tests.harness import run_ranks
from tests.training.test_nan_stop import _train


def test_a_tokenizer_that_does_not_match_the_data_stops_the_start(tiny_data):
    argv = tiny_flags(tiny_data, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
                      "--context-parallel-size", "2")
    results = run_ranks(_train, 2, argv)
    assert [code for code, _, _ in results] == [2, 2]
    assert all("pretrain_gpt.py: error:" in text for _, text, _ in results)  # every rank says it
    message = results[0][1]
    assert "pretrain_gpt.py: error:" in message and "_text_document.json" in message
    assert "EoD id 256" in message and "iteration" not in message
    # The message names the --vocab-size that gives NullTokenizer the data's EoD id (the
    # flag's value up to megatron-core 0.17, the value - 1 from 0.18).
    hint = re.search(r"train with --tokenizer-type NullTokenizer --vocab-size (\d+)$", message,
                     re.M)
    assert hint and NullTokenizer(int(hint.group(1))).eod == 256, message
