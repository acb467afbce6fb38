"""What the Trainer checks once the config is validated and before anything is built: the names
looked up in registries that live above config/ (group sizers, selection rules, logger
backends: checked in their own layers), and the warnings a valid but doubtful setting earns."""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def check_registries_and_warn(cfg) -> None:
    """Raise ConfigError naming the key for an unknown registered name; log each warning once (rank 0)."""
    from ..algo import POLICY_LOSSES
    from ..config.validation import stale_loss_warning
    from ..scheduling.group_sizing import check_group_sizing
    from ..scheduling.selection import check_selection
    from ..telemetry.tracking_backends import check_loggers
    check_loggers(cfg.trainer)
    check_group_sizing(cfg.rollout.group_sizing)
    check_selection(cfg.rollout.selection)
    warning = stale_loss_warning(cfg, POLICY_LOSSES)
    if warning and int(os.environ.get("RANK", "0")) == 0:     # before init_distributed: the launcher's rank
        log.warning(warning)
