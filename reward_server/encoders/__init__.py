"""Sentence encoder backends: texts in, L2-normalized float32 embeddings out."""

from reward_server.encoders.base import EMBEDDING_DIM, MAX_SEQ_LENGTH, Encoder

__all__ = ["EMBEDDING_DIM", "MAX_SEQ_LENGTH", "Encoder"]
