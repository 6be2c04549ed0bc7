"""Where the tests find Megatron-LM's trainer: $MEGATRON_LM_PATH (a checkout with
megatron/training, e.g. core_v0.16.1's ../shared/megatron-lm for the Python 3.11 stack), else
the installed megatron-core wheel's megatron.training (from 0.17; requirements/cpu.txt pins
0.19.2). Without either the suite cannot test the product: collection stops with one line."""

import argparse
import atexit
import contextlib
import functools
import importlib.util
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _installed_trainer():
    """The folder holding the installed megatron/training, or None."""
    try:
        spec = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(os.path.dirname(list(spec.submodule_search_locations)[0]))


MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH") or _installed_trainer()
if MEGATRON_LM is None or not os.path.isdir(os.path.join(MEGATRON_LM, "megatron", "training")):
    _WHERE = f"MEGATRON_LM_PATH={MEGATRON_LM}" if MEGATRON_LM else "no megatron.training installed"
    raise SystemExit(f"tests: Megatron-LM's trainer not found ({_WHERE}): run the suite through "
                     f"scripts/test_cpu.sh (megatron-core 0.19.2 carries it), or set "
                     f"MEGATRON_LM_PATH to a Megatron-LM checkout")


def subprocess_env(**extra: str) -> dict:
    """os.environ for a process that runs pretrain_gpt.py itself (torchrun): the checkout on
    PYTHONPATH (a 0.16 checkout is not installed), and `extra`."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH"), MEGATRON_LM) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)

_IMPORTED = False
_QUIET = tempfile.TemporaryFile("w+")
atexit.register(_QUIET.close)  # not left to the interpreter's teardown (a ResourceWarning)


def import_megatron_lm():
    """Put the checkout on sys.path and import Megatron-LM once, in the test process, so that
    forked ranks inherit it (the CPU patches it needs at import are applied and removed)."""
    global _IMPORTED
    if not _IMPORTED:
        if MEGATRON_LM not in sys.path:
            sys.path.append(MEGATRON_LM)
        from megatron_eod.megatron import cpu_compat

        # A real file, kept open: importing Megatron-LM calls faulthandler.enable(), which
        # needs the stderr of the moment to have a file descriptor (and keeps it).
        with contextlib.redirect_stderr(_QUIET):
            cpu_compat.apply(force=True, megatron_lm=True)
            cpu_compat.remove()
        _remember_help_texts()
        _IMPORTED = True
        _megatron_lm_flags()  # one parse here: the help texts are kept before any fork
        _import_what_ranks_import()


# What a training rank imported itself (a forked rank's new sys.modules, 0.19.2, a CP=4 run):
# Megatron-LM's modules it imports inside functions, and ours. Imported once here instead of
# in each rank of each run: 0.6 s of a 3.7 s CP=4 run of the tiny GPT (with
# PYTHONDONTWRITEBYTECODE, as on this machine, each rank also compiled our modules' source).
RANK_IMPORTS = ("pretrain_gpt", "pretrain_hybrid", "megatron_eod.training.run",
                "megatron_eod.training.providers", "megatron_eod.megatron.steps",
                "megatron_eod.megatron.layer_spec", "megatron_eod.megatron.hybrid_spec",
                "megatron_eod.megatron.mla", "megatron_eod.megatron.mtp",
                "megatron_eod.megatron.moe_compat", "megatron_eod.attention.triton_forward",
                "megatron.core.datasets.blended_megatron_dataset_builder",
                "megatron.core.datasets.helpers_cpp", "megatron.core.models.mimo",
                "megatron.core.tokenizers.text.models",
                "megatron.core.transformer.custom_layers.batch_invariant_kernels")


def _import_what_ranks_import():
    for name in RANK_IMPORTS:
        try:
            with contextlib.redirect_stderr(_QUIET):
                importlib.import_module(name)
        except ImportError:  # a module this Megatron-LM does not have
            pass


def _remember_help_texts():
    """Megatron-LM (0.16) reads the help texts of its config dataclasses from their source code
    (inspect + ast) at every parse of its flags: 0.12 s a parse, a few hundred parses in this
    suite, most of them in forked ranks. Tests only: each class's texts are read once, at the
    parse import_megatron_lm makes in the test process, and kept (the same texts: a class's
    source does not change in a run)."""
    try:
        from megatron.training.argument_utils import ArgumentGroupFactory
    except ImportError:  # a Megatron-LM without it
        return
    read = getattr(ArgumentGroupFactory, "_get_field_docstrings", None)
    if read is None:
        return
    texts = {}

    def remembered(self, src_cfg_class):
        if src_cfg_class not in texts:
            texts[src_cfg_class] = read(self, src_cfg_class)
        return dict(texts[src_cfg_class])

    ArgumentGroupFactory._get_field_docstrings = remembered


def null_tokenizer_vocab_size(eod: int) -> int:
    """The --vocab-size that gives megatron-core's NullTokenizer the EoD id `eod`: the value
    itself in 0.16, the value - 1 from 0.17."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return eod + (eod - NullTokenizer(eod).eod)


def megatron_lm_knows(flag: str) -> bool:
    """Whether the Megatron-LM under test has `flag` (versions add and drop some)."""
    import_megatron_lm()
    return flag in _megatron_lm_flags()


@functools.cache
def _megatron_lm_flags():
    """Every option string of Megatron-LM's parser (after import_megatron_lm)."""
    from megatron.training.arguments import add_megatron_arguments

    return frozenset(add_megatron_arguments(argparse.ArgumentParser(add_help=False))
                     ._option_string_actions)
