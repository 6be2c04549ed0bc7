"""megatron-eod: EoD-reset training under context parallelism for Megatron."""

from setuptools import find_packages, setup

setup(
    name="megatron-eod",
    version="0.1.0",
    description="EoD-reset (document-masked) training with Ring, Ulysses and Hybrid context "
                "parallelism for Megatron, on GPUs and CPUs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_eod", "megatron_eod.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.20",  # >= 0.17 carries Megatron-LM's trainer (Python 3.12)
        "psutil",  # Megatron-LM's trainer: its checkpoint saves fail without it
        "einops>=0.8",
        "numpy>=1.26",
        "packaging",
    ],
    extras_require={
        # CUDA-only source builds: install on GPU machines with a matching CUDA toolkit.
        "gpu": ["flash-attn>=2.6", "transformer-engine[pytorch]>=2.0"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "tokenizers>=0.20"],
        "hf": ["tokenizers>=0.20", "transformers>=4.40"],
        "zstd": ["zstandard>=0.22"],  # preprocessing .jsonl.zst inputs
    },
    license="Apache-2.0",
)
