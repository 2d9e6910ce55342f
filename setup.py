"""Packaging for megatron-plugins: heterogeneous MiMo training on Megatron's stock pretrain()."""

from setuptools import find_packages, setup

MEGATRON_CORE = "megatron-core==0.19.2"
TORCH = "torch==2.14.1"
DATA = [
    # Megatron's multimodal loader; WebDataset shards prepared by `energon prepare`.
    "megatron-energon==7.4.1",
    # HuggingFaceTokenizer (stock --tokenizer-type) and offline tokenizer training in tests.
    "transformers==5.23.0",
    "tokenizers==0.23.3",
    "tqdm==4.70.1",
]

setup(
    name="megatron-plugins",
    version="0.1.0",
    description=(
        "Plugins for Megatron-LM's stock pretrain(): non-colocated, heterogeneous-parallel "
        "multimodal (MiMo) training, plus a CPU simulation of the stock loop for testing."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_plugins", "megatron_plugins.*"]),
    python_requires=">=3.12",
    install_requires=[
        MEGATRON_CORE,
        TORCH,
        "numpy>=1.26,<3",
        "packaging>=24.2",
        "einops==0.8.1",
        "omegaconf==2.3.0",
        "pyyaml>=6.0",
        # Megatron's distributed checkpoint writer imports it at save time.
        "psutil==7.2.2",
        # Images: the built-in encoders' preprocessing and the step timeline's picture.
        "pillow==13.0.0",
        # Audio: decoding (libsndfile: WAV, FLAC, MP3, ...) and resampling to the encoder's rate,
        # what transformers' load_audio falls back to (media/codec.py).
        "soundfile==0.14.0",
        "soxr==1.1.0",
        # Video files (mp4, webm, mkv, mov, avi): frames and sound track, as transformers'
        # load_video reads them by default (media/video.py).
        "av==19.0.2",
    ],
    extras_require={
        # Transformer Engine (GPU clusters). Apex is optional and built from source, never required.
        "te": ["transformer-engine[pytorch,core_cu13]==2.14.0"],
        "ssm": ["mamba-ssm==2.2.6.post3", "causal-conv1d==1.5.3.post1"],
        # Gated DeltaNet's Triton kernels (Qwen3.5, GPU); megatron-core 0.19.2's own dev extra
        # asks for ~=0.4.0. Without it the reference kernels run (compat Gap 30).
        "fla": ["flash-linear-attention==0.4.2"],
        "data": DATA,
        "test": DATA + [
            "pytest==8.4.2",
            "pytest-timeout==2.4.0",
            # scripts/test.sh runs the suite on two workers: one's ranks compute while the
            # other's wait on each other (tests/harness/worker_cache.py shares their runs).
            "pytest-xdist==3.8.0",
            "tensorboard==2.20.0",
            # The reference for video preprocessing: HF's video processor resizes with it.
            "torchvision==0.29.1",
            # The outside check of exported LoRA adapters: peft loads them onto transformers.
            "peft==0.21.2",
        ],
    },
    entry_points={
        "console_scripts": ["mimo-plan=megatron_plugins.launch.plan:main"],
    },
)
