"""Measuring, in one place, one concern per module:

* :mod:`.timing`: functions timed side by side (``measure``, ``Timing``),
  the steps of a loop (``StepTimer``), the one clock (``stopwatch``);
* :mod:`.noise`: the noise rule (``outside_noise``, ``choose``);
* :mod:`.compiling`: what ``torch.compile`` did (``compile_counter``);
* :mod:`.profiles`: the kernels that ran, memory, where time goes;
* :mod:`.bound`: the work bound (``Work``, ``model_work``, ``work_bound``,
  ``speedup_line``);
* :mod:`.compare`: one attention job checked and timed on every backend;
* :mod:`.tables`: measured figures as the pages print them.

The page ``measuring_ragged_batches`` explains the machinery once. A page imports
each name from its module, so the build knows which modules it uses.
"""

__all__ = []
