"""The sequence-classification head of BERT-family cross-encoders (ms-marco-MiniLM, bge-reranker,
mxbai-rerank): one score (or one per label) for a whole input, read from its first token.

BertForSequenceClassification and RobertaForSequenceClassification compute the same thing
under different tensor names; both are a dense tanh layer over the first token's final state
and a linear projection to the labels (dropout is off at inference):

    BERT:     tanh(bert.pooler.dense(h[CLS]))   -> classifier          -> [num_labels]
    RoBERTa:  tanh(classifier.dense(h[<s>]))     -> classifier.out_proj -> [num_labels]

The head runs on the encoder's last hidden states (engine/model/bert.py); a cross-encoder reads
the query and the passage as one input (two segments, token types 0 and 1), so attention runs
across both and the head scores the pair.
"""

from __future__ import annotations

import torch
from torch import nn

# a checkpoint's head tensors (base-model prefix stripped) -> the head's own names
_HEAD_NAMES = {
    "pooler.dense.weight": "dense.weight",  # BERT
    "pooler.dense.bias": "dense.bias",
    "classifier.weight": "out_proj.weight",
    "classifier.bias": "out_proj.bias",
    "classifier.dense.weight": "dense.weight",  # RoBERTa
    "classifier.dense.bias": "dense.bias",
    "classifier.out_proj.weight": "out_proj.weight",
    "classifier.out_proj.bias": "out_proj.bias",
}


class SequenceClassificationHead(nn.Module):
    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [batch, seq, hidden] -> [batch, num_labels] logits (float32)."""
        return self.out_proj(torch.tanh(self.dense(hidden[:, 0]))).float()


def pop_head_tensors(
    state_dict: dict[str, torch.Tensor], prefixes: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """Take the head's tensors out of a cross-encoder's `state_dict` (under the head's names);
    what is left is the encoder's."""
    head = {}
    for name in list(state_dict):
        bare = name
        for prefix in prefixes:
            bare = bare.removeprefix(prefix)
        if bare in _HEAD_NAMES:
            head[_HEAD_NAMES[bare]] = state_dict.pop(name)
    return head


def build_head(
    architecture: str,
    hidden_size: int,
    num_labels: int,
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device,
) -> SequenceClassificationHead:
    """The head with the checkpoint's weights; ValueError naming what is missing or misshapen."""
    with torch.device("meta"):
        head = SequenceClassificationHead(hidden_size, num_labels)
    wanted = head.state_dict()
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise ValueError(
            f"{architecture} checkpoint lacks its classification head's {', '.join(missing)}"
        )
    for name, tensor in tensors.items():
        if tensor.shape != wanted[name].shape:
            raise ValueError(
                f"{architecture} checkpoint's head tensor {name} has shape {tuple(tensor.shape)}"
                f" but config.json (hidden_size {hidden_size}, num_labels {num_labels}) makes it "
                f"{tuple(wanted[name].shape)}"
            )
    head.load_state_dict(
        {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, assign=True
    )
    return head.eval()
