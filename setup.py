"""Builds the C ring (shm._ring); everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shm._ring",
            sources=["shm/src/ring.c", "shm/src/_ring.c"],
            depends=["shm/src/ring.h"],
            extra_compile_args=[
                "-std=gnu11",
                "-O2",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
            ],
            libraries=["rt"],
        )
    ]
)
