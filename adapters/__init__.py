"""Backend adapters, shipped as ``metricbus.adapters``."""
