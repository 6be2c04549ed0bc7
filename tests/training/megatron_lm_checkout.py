"""Where the tests find Megatron-LM's own trainer: $MEGATRON_LM_PATH, else
../shared/megatron-lm (core_v0.16.1's megatron/training and pretrain_gpt.py). Tests that need
it carry `needs_megatron_lm` and skip, saying where they looked, when it is absent."""

import argparse
import atexit
import contextlib
import functools
import os
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH") or os.path.join(REPO, "..", "shared",
                                                                 "megatron-lm")
HAVE_MEGATRON_LM = os.path.isdir(os.path.join(MEGATRON_LM, "megatron", "training"))
needs_megatron_lm = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=(
    f"Megatron-LM's trainer not found at {MEGATRON_LM} (set MEGATRON_LM_PATH to a checkout "
    f"with megatron/training)"))

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
