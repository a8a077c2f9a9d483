"""Shared code of the benchmark scripts in ``benchmarks/``.

- :mod:`benchlib.cli`: the command-line options the scripts share;
- :mod:`benchlib.problems`: shapes, ragged offsets, and inputs in MLA's layout (``v`` a strided view),
  for single attention calls and for stacks of MLA layers;
- :mod:`benchlib.methods`: what is timed: the ops through ``mla_ops``, the backends called directly,
  and each library's raw call; the correctness check against fp32 reference math;
- :mod:`benchlib.timing`: the one timer, and the alternating-rounds helper for ratios;
- :mod:`benchlib.handout`: where Triton puts a warp-specialised kernel's hand-out of its partitions (source lines,
  PTX accesses), for ``sanitize.py`` and ``compile_sm90.py``;
- :mod:`benchlib.report`: the environment record (GPU, clocks, versions), progress messages, and
  CSV / Markdown / PNG output.

The scripts put ``benchmarks/`` on ``sys.path`` and import these as ``benchlib.*``. Everything here
imports ``torch`` and ``mla_ops`` lazily or is cheap, so that a script's ``--help`` stays fast.
"""
