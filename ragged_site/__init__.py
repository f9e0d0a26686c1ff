"""The site's machinery, apart from the library (:mod:`ragged_toolkit`): what
the pages use to set themselves up, measure, draw, prove and decide. It is
shown so that a reader can check how each figure was made; it is not code
to copy into a trainer or a server.

* :mod:`ragged_site.page`: a page's device, dtype, sizes and quick mode
  (``page_setup``), tolerances, quiet logs;
* :mod:`ragged_site.workloads`: the synthetic lengths, batches and request
  streams the pages measure on; :mod:`ragged_site.corpus`: the real text
  they train and serve on;
* :mod:`ragged_site.measuring`: timings, the noise rule, compile counts,
  profiles, the work bound, backend comparisons: every figure a page prints;
* :mod:`ragged_site.records`: every printed figure as a record (JSON
  Lines), for the GPU check;
* :mod:`ragged_site.reference`: the attention every backend is checked
  against;
* :mod:`ragged_site.figures`: the pictures the pages draw (matplotlib);
* :mod:`ragged_site.decision`: the decision guide's paths and table;
* :mod:`ragged_site.data_parallel`, :mod:`ragged_site.data_parallel_launch`:
  the data-parallel page's checks and the launch of its ranks;
* :mod:`ragged_site.serving`: the serving pages' metrics, proofs against
  decoding alone, repeated runs, request streams that share prompts, and
  the prefix cache's tree.

A page imports each name from its module, so the build knows which modules
it uses.
"""

__all__ = []
