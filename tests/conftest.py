"""Test-wide settings.

One intra-op thread: on a 2-core machine shared with other processes, torch's OpenMP threads
can spin against each other and make tiny-model tests ~100x slower; one thread is always fast.
"""

import torch

torch.set_num_threads(1)
