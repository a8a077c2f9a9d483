"""The command line: ``python -m mla_ops {info,demo,warmup,tune}``."""
