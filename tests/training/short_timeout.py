"""pretrain_gpt.py with --distributed-timeout-minutes below one minute, for test_faults.py's
stopped rank (Megatron-LM's flag takes whole minutes): $EOD_TEST_TIMEOUT_MINUTES replaces
the parsed value right after Megatron-LM's validate_args, before its process groups exist.

    torchrun ... tests/training/short_timeout.py <pretrain_gpt.py's flags>
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron_eod.training import run  # noqa: E402

_checked = run.eod_args_from_megatron


def _shortened(args):
    _checked(args)
    args.distributed_timeout_minutes = float(os.environ["EOD_TEST_TIMEOUT_MINUTES"])


run.eod_args_from_megatron = _shortened

if __name__ == "__main__":
    import pretrain_gpt

    pretrain_gpt.main()
