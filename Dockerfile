# kvbatch's image: `kvbatch` is the entrypoint (docker run IMAGE worker --model ...).
#
#   docker build -t kvbatch .                                   torch from PyPI (CUDA on x86_64)
#   docker build --build-arg TORCH_SPEC=torch==2.5.1 -t kvbatch .   a pinned torch
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t kvbatch .
#                                                               a CPU-only torch (smaller)
FROM python:3.11-slim

ARG TORCH_SPEC="torch>=2.5"
ARG TORCH_INDEX_URL=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, on its own layer: it is the big one and changes least. The project's
# `torch>=2.5` is then already met, so `pip install .` does not pull another build.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvbatch ./kvbatch
RUN pip install . && rm -rf build

# Non-root; models are mounted read-only at /models, the cache lives in the user's home.
# /state: beat's schedule file, on a named volume (compose.yaml), which takes this owner.
RUN useradd --create-home --uid 1000 kvbatch && mkdir /state && chown kvbatch /state
USER kvbatch
ENV KVBATCH_CACHE=/home/kvbatch/.cache/kvbatch

ENTRYPOINT ["kvbatch"]
CMD ["--help"]
