"""megatron-paradyse: per-micro-batch, per-layer parallel-strategy switching for Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron-paradyse",
    version="0.1.0",
    description="Dynamic-sequence parallel-strategy switching (ParaDySe) for Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_paradyse", "megatron_paradyse.*"]),
    install_requires=[
        # A CPU machine must install torch==2.13.0 first (scripts/install.sh): an unpinned resolve
        # pulls the CUDA wheels.
        "torch>=2.6",
        "megatron-core==0.19.2",
        "numpy",
        "packaging>=24.2",
        "pyyaml",
        "psutil",  # megatron-core distributed checkpointing
        "scikit-learn",  # the paper's empirical cost model, for comparison
        "matplotlib",  # the demo's and the benchmarks' plots
    ],
    entry_points={
        "console_scripts": [
            "paradyse = megatron_paradyse.cli:main",
            "paradyse-pretrain-gpt = megatron_paradyse.pretrain_gpt:main",
        ]
    },
    extras_require={
        "gpu": ["transformer-engine[pytorch]", "flash-attn>=2.6"],
        "test": ["pytest", "pytest-timeout", "tensorboard"],  # tensorboard: reading event files back
    },
)
