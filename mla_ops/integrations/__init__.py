"""Adapters that let other libraries' model code run its attention through the ``mla`` ops."""
