"""data/index_cache.py: megatron-core's cached sample indices of a dataset re-made into the
same prefix are refused by name (they indexed the new data wrongly), not used."""

import json
import os
import re

import pytest

from megatron_eod.data.checks import DatasetError
from megatron_eod.data.index_cache import cache_folder, check_index_cache
from megatron_eod.data.preprocess import preprocess_jsonl
from megatron_eod.data.tokenizers import ByteTokenizer
from megatron_eod.megatron.dataset import build_gpt_datasets


def make(tmp_path, words):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{w} " * (3 + i % 7)}) + "\n"
                              for i, w in enumerate(words)))
    preprocess_jsonl(str(corpus), str(tmp_path / "c"), ByteTokenizer(), append_eod=True,
                     log=lambda m: None)
    return str(tmp_path / "c_text_document")


def build(prefix, cache):
    return build_gpt_datasets(prefix, 16, ByteTokenizer(), [40, 0, 0], split="100,0,0",
                              path_to_cache=cache)[0]


@pytest.mark.parametrize("shared_cache", [False, True], ids=["default-folder", "cache-path"])
def test_a_cache_of_a_remade_dataset_is_refused(tmp_path, shared_cache):
    cache = str(tmp_path / "cache") if shared_cache else None
    prefix = make(tmp_path, ["alpha"] * 60)
    check_index_cache(prefix, cache)  # stamps the (new) cache
    first = build(prefix, cache)
    assert os.listdir(cache_folder(prefix, cache))
    check_index_cache(prefix, cache)  # the same data: fine
    make(tmp_path, ["alpha"] * 60)  # re-made identically: the cache still fits
    check_index_cache(prefix, cache)
    assert build(prefix, cache)[0]["tokens"].tolist() == first[0]["tokens"].tolist()
    make(tmp_path, ["a much longer document than before"] * 90)
    with pytest.raises(DatasetError, match="cached sample indices of .*c_text_document there "
                                           "were built from another.*delete their files "
                                           "\\([0-9a-f]+-GPTDataset-train-\\*\\), or the "
                                           "whole folder \\(megatron-core builds again the "
                                           "indices it needs: rm -r .*\\), or pass another "
                                           "--data-cache-path"):
        check_index_cache(prefix, cache)
    folder = cache_folder(prefix, cache)
    for name in os.listdir(folder):  # deleted as the message says: the stamp is renewed
        if "GPTDataset" in name:
            os.remove(os.path.join(folder, name))
    check_index_cache(prefix, cache)
    check_index_cache(prefix, cache)


def test_a_stamp_without_cached_indices_does_not_refuse_new_data(tmp_path):
    """A run that stopped after the stamp but before megatron-core built anything (e.g. at a
    later start-up check), then the data re-made as that check advised: nothing is stale."""
    prefix = make(tmp_path, ["alpha"] * 60)
    check_index_cache(prefix, None)
    make(tmp_path, ["a much longer document than before"] * 90)
    check_index_cache(prefix, None)
    build(prefix, None)
    check_index_cache(prefix, None)


@pytest.mark.parametrize("under", [False, True], ids=["is-a-file", "under-a-file"])
def test_a_file_in_the_cache_folders_way_is_named(tmp_path, under):
    """megatron-core's own makedirs stopped rank 0 with a FileExistsError traceback (the other
    ranks: gloo's 'Connection closed by peer'); the check was silent about it."""
    prefix = make(tmp_path, ["alpha"] * 20)
    blocker = tmp_path / "afile"
    blocker.write_text("")
    cache = str(blocker / "sub") if under else str(blocker)
    with pytest.raises(DatasetError, match=f"--data-cache-path {re.escape(cache)}: .*afile is a "
                                           f"file, where megatron-core makes its cache folder"):
        check_index_cache(prefix, cache)


def test_a_link_to_nowhere_as_the_cache_folder_is_named(tmp_path):
    prefix = make(tmp_path, ["alpha"] * 20)
    link = tmp_path / "cache"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(DatasetError, match=f"--data-cache-path {re.escape(str(link))}: "
                                           f"{re.escape(str(link))} is a link to nowhere"):
        check_index_cache(prefix, str(link))
