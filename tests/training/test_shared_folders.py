"""Folders the ranks share (training/shared_folders.py): --save and the sample-index cache on
node-local disks stop every rank at start-up by name (both failed late: a save every node held
a part of, found at the next --load; a FileNotFoundError traceback on the other nodes' ranks).
Nodes are stood in for by a host name per rank and a working folder per rank, so that one
relative path names another folder on each "node"."""

import os
import shutil
import socket

import pytest

from megatron_eod.training.cp_flags import FlagError
from megatron_eod.training.shared_folders import check_shared_folders, save_folder
from tests.harness import run_ranks
from tests.training.megatron_lm_checkout import import_megatron_lm
from tests.training.runs import flags, start

pytestmark = pytest.mark.timeout(240)


def _on_node(rank, nodes, folders):
    """This rank on node `nodes[rank]`, working in `folders[rank]`."""
    socket.gethostname = lambda: f"node{nodes[rank]}"
    os.chdir(folders[rank])


def _check(rank, world, nodes, folders):
    from types import SimpleNamespace

    _on_node(rank, nodes, folders)
    try:
        check_shared_folders(save_folder(SimpleNamespace(save="ckpt")), FlagError)
    except FlagError as error:
        return str(error)
    return sorted(os.listdir("ckpt")) if rank == 0 else None  # rank 0 removed the probe


def test_a_save_folder_only_some_nodes_see_stops_every_rank(tmp_path):
    shared, local = str(tmp_path / "shared"), str(tmp_path / "node1")
    for folder in (shared, local):
        os.makedirs(folder)
    assert run_ranks(_check, 3, [0, 0, 1], [shared] * 3) == [[], None, None]  # one folder
    # One host: not checked (no node-local disk to fear).
    assert run_ranks(_check, 3, [0, 0, 0], [shared, shared, local]) == [[], None, None]
    errors = run_ranks(_check, 3, [0, 0, 1], [shared, shared, local])
    assert errors == [errors[0]] * 3 and errors[0] == (
        "--save ckpt (every rank writes its part of each checkpoint there, rank 0 the tracker) "
        "is not shared between the nodes: rank 2 (node1) does not see the file rank 0 (node0) "
        "wrote into ckpt (1 of 3 ranks do not); give a folder every node shares (a shared file "
        "system)")
    assert os.listdir(os.path.join(shared, "ckpt")) == []


def _start_on_node(rank, world, nodes, folders, argv):
    _on_node(rank, nodes, folders)
    return start(rank, world, argv)


def test_node_local_data_needs_a_shared_index_cache(short_docs_data, tmp_path):
    """Each node with its own copy of the data (the copies check passes: the same bytes) and
    the default cache beside it: the other node's ranks found no indices (FileNotFoundError)."""
    import_megatron_lm()
    folders = []
    for node in ("node0", "node1"):
        folder = tmp_path / node / "data"
        folder.mkdir(parents=True)
        for ext in (".bin", ".idx", ".json"):
            if os.path.exists(short_docs_data + ext):
                shutil.copy(short_docs_data + ext, folder / ("d" + ext))
        folders.append(str(tmp_path / node))
    argv = flags("data/d", None, "--context-parallel-size", "2", "--train-iters", "2")
    results = run_ranks(_start_on_node, 2, [0, 1], folders, argv, timeout=240, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    for _, text in results:
        assert "pretrain_gpt.py: error: the sample-index cache data/d/cache/GPTDataset_indices " \
               "(beside the dataset: no --data-cache-path; megatron-core builds the indices on " \
               "rank 0 and the other ranks read them there) is not shared between the nodes: " \
               "rank 1 (node1) does not see" in text, text[-2000:]
    shared = str(tmp_path / "cache")  # a shared --data-cache-path: it trains
    results = run_ranks(_start_on_node, 2, [0, 1], folders,
                        argv + ["--data-cache-path", shared], timeout=240, daemon=False)
    assert [code for code, _ in results] == [0, 0], results


def test_a_node_local_save_is_refused(short_docs_data, tmp_path):
    import_megatron_lm()
    folders = [str(tmp_path / node) for node in ("node0", "node1")]
    for folder in folders:
        os.makedirs(folder)
    argv = flags(short_docs_data, None, "--save", "ckpt")
    results = run_ranks(_start_on_node, 2, [0, 1], folders, argv, timeout=200, daemon=False)
    assert [code for code, _ in results] == [2, 2], results
    assert "pretrain_gpt.py: error: --save ckpt (every rank writes its part of each checkpoint " \
           "there, rank 0 the tracker) is not shared between the nodes: rank 1 (node1)" in \
        results[1][1]
