"""The optional C loops (metricbus/_speedups.c); everything else is configured in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "metricbus._speedups",
            sources=["metricbus/_speedups.c"],
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,  # without a compiler metricbus runs its numpy code (metricbus/native.py)
        )
    ]
)
