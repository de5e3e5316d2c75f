"""The learning-rate schedule that train.py (the SFT of Appendix A.1) and router.py (the gates of
Appendix E) share: linear warm-up from 0, then cosine to 0, as HF's get_cosine_schedule_with_warmup
has it. A multiplier of the peak rate for torch.optim.lr_scheduler.LambdaLR.
"""

from __future__ import annotations

import math


def lr_lambda(total: int, warmup_ratio: float):
    """Linear warm-up over ceil(warmup_ratio * total) steps from 0, then cosine to 0 at step total."""
    warm = math.ceil(warmup_ratio * total)

    def f(step: int) -> float:
        if step < warm:
            return step / max(1, warm)
        return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    return f
