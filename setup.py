"""sglang-dspine: DSpine speculative decoding for SGLang (serving plugin, trainer, benchmarks)."""
from setuptools import setup

setup(
    name="sglang-dspine",
    version="0.1.0",
    description="DSpine parallel speculative drafter: SGLang serving plugin, trainer and benchmarks",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # `kernels/` is shipped as the subpackage `sglang_dspine.kernels`: a top-level `kernels` module would
    # shadow the unrelated `kernels` package that transformers and sglang import.
    packages=["sglang_dspine", "sglang_dspine.kernels"],
    package_dir={"sglang_dspine": "sglang_dspine", "sglang_dspine.kernels": "kernels"},
    install_requires=[
        # SGLang pins torch 2.11.0, triton 3.6.0, transformers 5.12.1; we take exactly its pins.
        "sglang==0.5.17",
        "torch==2.11.0",
        "transformers==5.12.1",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest", "matplotlib", "tensorboard"],  # the lab tests draw its plots; the trainer's logs are read
        "lab": ["matplotlib", "tokenizers"],
        "train": ["tensorboard"],  # TensorBoard logs beside metrics.jsonl (wandb: install it yourself)
    },
    entry_points={
        "console_scripts": ["sglang-dspine=sglang_dspine.cli:main"],
        "sglang.srt.plugins": ["dspine=sglang_dspine.plugin:register"],
    },
)
