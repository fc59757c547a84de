"""The tasks behind ``stoker demo``: synthetic data, small models and their losses.

:mod:`~stoker.demo.volume` (3D conv denoiser on crops of a sharded volume),
:mod:`~stoker.demo.points` (point-cloud denoiser on records with k-NN edges),
:mod:`~stoker.demo.run` (the per-rank jobs and the summary the CLI prints).
"""
