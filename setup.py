"""Builds the one C extension, fastai_resume._core, from csrc/ (the rest is in pyproject.toml)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fastai_resume._core",
            sources=[
                "csrc/module.c",
                "csrc/validate.c",
                "csrc/builder.c",
                "csrc/commit.c",
                "csrc/reader.c",
                "csrc/load.c",
                "csrc/crc32c.c",
                "csrc/skip.c",
            ],
            depends=["csrc/frk.h", "csrc/layout.h", "csrc/internal.h"],
            extra_compile_args=[
                "-std=c11",
                "-O2",
                "-Wall",
                "-Wextra",
                "-Wno-missing-field-initializers",
                "-Wno-cast-function-type",
            ],
            # no OpenMP runtime linked: the snapshot copy's team runs on torch's, found with dlopen (csrc/crc32c.c)
            libraries=["pthread", "dl"],
        )
    ]
)
