"""The CTranslate2 model of an fp32 export, read from the export's own graph (no torch).

The ``ctranslate2`` backend runs the same weights as onnxruntime does, so it is built from the
export a user already has (the embedded default, a Hugging Face folder or hub id, or an export
folder given by path) rather than from a second download: the fp32 CPU graph of
:mod:`onnx_export` is BERT with onnxruntime's fusions (``EmbedLayerNormalization``, one
``Attention`` per layer holding the packed Q, K, V projections, then ``MatMul`` + bias, the
residual ``Add``, ``LayerNormalization``, the feed-forward with ``BiasGelu``), and its
initializers are the model's weights unchanged. :func:`read_bert_weights` walks that graph
from tensor to consumer, checking each operator on the way, so a graph of another shape (an
architecture other than BERT, a tanh-approximated GELU, an old export that fuses each residual
into its layer norm) is refused by name instead of being converted into a different model.

The conversion runs once per export, in a child process (``python -m
reward_server.encoders.ctranslate2_convert EXPORT OUT``): reading the graph holds the weights
twice for a moment, and the serving process should not keep that high-water mark
(:func:`reward_server.encoders.model_store.ensure_ctranslate2_model`).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from reward_server.encoders.model_store import MODEL_FILE

Array = npt.NDArray[np.float32]
#: The vocabulary file of BERT exports (one token per line), copied from the source folder.
VOCAB_FILE = "vocab.txt"


class UnsupportedGraphError(ValueError):
    """The export's graph is not the fp32 BERT graph that the ctranslate2 backend converts."""


@dataclass(frozen=True)
class Linear:
    """A projection as CTranslate2 stores it: ``weight`` is (out, in), ``bias`` is (out,)."""

    weight: Array
    bias: Array


@dataclass(frozen=True)
class LayerNorm:
    gamma: Array
    beta: Array


@dataclass(frozen=True)
class BertLayer:
    qkv: Linear  # Q, K, V projections stacked along the output axis, in that order
    attention_out: Linear
    attention_norm: LayerNorm
    ffn_in: Linear
    ffn_out: Linear
    ffn_norm: LayerNorm


@dataclass(frozen=True)
class BertWeights:
    word_embeddings: Array
    position_embeddings: Array
    token_type_embeddings: Array
    embedding_norm: LayerNorm
    layers: tuple[BertLayer, ...]
    num_heads: int
    epsilon: float


class _Graph:
    """The export's nodes by the tensors they read, and its initializers as arrays."""

    def __init__(self, model: Any) -> None:
        from onnx import numpy_helper

        self.initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        self.consumers: dict[str, list[Any]] = defaultdict(list)
        for node in model.graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.nodes = list(model.graph.node)

    def only(self, op_type: str) -> Any:
        found = [n for n in self.nodes if n.op_type == op_type]
        if len(found) != 1:
            raise UnsupportedGraphError(f"expected one {op_type} node, found {len(found)}")
        return found[0]

    def next(self, tensor: str, op_types: Sequence[str], *, optional: bool = False) -> Any:
        """The one node of one of ``op_types`` that reads ``tensor``."""
        found = [n for n in self.consumers.get(tensor, ()) if n.op_type in op_types]
        if len(found) > 1 or (not found and not optional):
            raise UnsupportedGraphError(
                f"expected one {'/'.join(op_types)} reading {tensor!r}, found "
                f"{[n.op_type for n in self.consumers.get(tensor, ())]}"
            )
        return found[0] if found else None

    def weight(self, node: Any, index: int) -> Array:
        name = node.input[index]
        if name not in self.initializers:
            raise UnsupportedGraphError(
                f"{node.op_type} {node.name!r}: input {name!r} is not a weight"
            )
        return self._array(name)

    def bias_of(self, add: Any) -> Array:
        """The constant operand of a bias ``Add`` (the other is the activation)."""
        constants = [name for name in add.input if name in self.initializers]
        if len(constants) != 1:
            raise UnsupportedGraphError(f"Add {add.name!r} is not a bias addition")
        return self._array(constants[0])

    def _array(self, name: str) -> Array:
        return np.ascontiguousarray(self.initializers[name], dtype=np.float32)

    def norm(self, node: Any) -> LayerNorm:
        return LayerNorm(self.weight(node, 1), self.weight(node, 2))


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _linear(g: _Graph, node: Any, bias: Array) -> Linear:
    """The projection whose weight is ``node``'s second input: ONNX's ``MatMul`` and
    ``Attention`` hold it (in, out); CTranslate2 stores (out, in)."""
    return Linear(np.ascontiguousarray(g.weight(node, 1).T), bias)


def _layer(g: _Graph, x: str, attention: Any, epsilon: float) -> tuple[BertLayer, str]:
    """One encoder layer from its ``Attention`` node; returns it and the layer's output.
    ``epsilon`` is the embeddings' layer norm's: CTranslate2 has one for every layer norm."""
    if _attr(attention, "unidirectional", 0) or _attr(attention, "scale", 0.0):
        raise UnsupportedGraphError(f"{attention.name!r}: not BERT's bidirectional attention")
    qkv = _linear(g, attention, g.weight(attention, 2))
    width = qkv.weight.shape[1]
    if qkv.weight.shape != (3 * width, width):  # Q, K and V of the model's width each
        raise UnsupportedGraphError(f"{attention.name!r}: Q, K, V of unequal widths")
    out_mm = g.next(attention.output[0], ["MatMul"])
    out_bias = g.next(out_mm.output[0], ["Add"])
    residual = g.next(out_bias.output[0], ["Add"])
    if x not in residual.input:
        raise UnsupportedGraphError(f"{residual.name!r} does not add the layer's input back")
    norm1 = g.next(residual.output[0], ["LayerNormalization", "SkipLayerNormalization"])
    if norm1.op_type != "LayerNormalization":
        raise UnsupportedGraphError(
            "the export fuses each residual into its layer norm (an older sde2 made it): "
            "export it again (sde2-reward export)"
        )
    ffn_mm = g.next(norm1.output[0], ["MatMul"])
    gelu = g.next(ffn_mm.output[0], ["BiasGelu", "Add"])
    if gelu.op_type == "BiasGelu":
        ffn_bias = g.weight(gelu, 1)
    else:  # the bias Add apart from an exact Gelu
        ffn_bias = g.bias_of(gelu)
        gelu = g.next(gelu.output[0], ["Gelu"])
        if _attr(gelu, "approximate", b"none") not in (b"none", "none"):
            raise UnsupportedGraphError(f"{gelu.name!r} approximates GELU")
    down_mm = g.next(gelu.output[0], ["MatMul"])
    down_bias = g.next(down_mm.output[0], ["Add"])
    residual2 = g.next(down_bias.output[0], ["Add"])
    if norm1.output[0] not in residual2.input:
        raise UnsupportedGraphError(f"{residual2.name!r} does not add the attention block back")
    norm2 = g.next(residual2.output[0], ["LayerNormalization"])
    for norm in (norm1, norm2):
        if not np.isclose(float(_attr(norm, "epsilon", 1e-5)), epsilon, rtol=1e-6, atol=0.0):
            raise UnsupportedGraphError(f"{norm.name!r}: an epsilon other than the embeddings'")
    layer = BertLayer(
        qkv=qkv,
        attention_out=_linear(g, out_mm, g.bias_of(out_bias)),
        attention_norm=g.norm(norm1),
        ffn_in=_linear(g, ffn_mm, ffn_bias),
        ffn_out=_linear(g, down_mm, g.bias_of(down_bias)),
        ffn_norm=g.norm(norm2),
    )
    return layer, norm2.output[0]


def read_bert_weights(model_path: str | Path) -> BertWeights:
    """BERT's weights from an fp32 CPU export (:mod:`onnx_export`), checked operator by
    operator; :class:`UnsupportedGraphError` says what differs."""
    import onnx

    g = _Graph(onnx.load(str(model_path)))
    embed = g.only("EmbedLayerNormalization")
    if len(embed.input) < 7 or not embed.input[4]:
        raise UnsupportedGraphError("the embeddings have no token type table (not BERT)")
    epsilon = float(_attr(embed, "epsilon", 1e-12))
    layers: list[BertLayer] = []
    x = embed.output[0]
    heads: set[int] = set()
    while (attention := g.next(x, ["Attention"], optional=True)) is not None:
        heads.add(int(_attr(attention, "num_heads")))
        layer, x = _layer(g, x, attention, epsilon)
        layers.append(layer)
    if not layers:
        raise UnsupportedGraphError("no Attention node reads the embeddings")
    attentions = sum(n.op_type == "Attention" for n in g.nodes)
    if attentions != len(layers) or len(heads) != 1:
        raise UnsupportedGraphError(
            f"{attentions} Attention nodes, {len(layers)} of them one layer after another, "
            f"with {sorted(heads)} heads: not one stack of equal layers"
        )
    return BertWeights(
        word_embeddings=g.weight(embed, 2),
        position_embeddings=g.weight(embed, 3),
        token_type_embeddings=g.weight(embed, 4),
        embedding_norm=LayerNorm(g.weight(embed, 5), g.weight(embed, 6)),
        layers=tuple(layers),
        num_heads=heads.pop(),
        epsilon=epsilon,
    )


def build_spec(weights: BertWeights, vocabulary: Sequence[str], unk_token: str = "[UNK]") -> Any:
    """CTranslate2's specification of ``weights``: the encoder its BERT loader builds, without
    the pooler (sentence embeddings mean-pool the last hidden states)."""
    from ctranslate2.specs import common_spec, transformer_spec

    encoder = transformer_spec.TransformerEncoderSpec(
        len(weights.layers),
        weights.num_heads,
        pre_norm=False,
        activation=common_spec.Activation.GELU,
        layernorm_embedding=True,
        num_source_embeddings=2,
        embeddings_merge=common_spec.EmbeddingsMerge.ADD,
    )
    spec = transformer_spec.TransformerEncoderModelSpec(encoder)
    spec.encoder.scale_embeddings = False
    spec.encoder.embeddings[0].weight = weights.word_embeddings
    spec.encoder.embeddings[1].weight = weights.token_type_embeddings
    spec.encoder.position_encodings.encodings = weights.position_embeddings
    _set_norm(spec.encoder.layernorm_embedding, weights.embedding_norm)
    for layer_spec, layer in zip(spec.encoder.layer, weights.layers, strict=True):
        _set_linear(layer_spec.self_attention.linear[0], layer.qkv)
        _set_linear(layer_spec.self_attention.linear[1], layer.attention_out)
        _set_norm(layer_spec.self_attention.layer_norm, layer.attention_norm)
        _set_linear(layer_spec.ffn.linear_0, layer.ffn_in)
        _set_linear(layer_spec.ffn.linear_1, layer.ffn_out)
        _set_norm(layer_spec.ffn.layer_norm, layer.ffn_norm)
    tokens = list(vocabulary)
    # BERT's loader pads the vocabulary to the embedding table's rows the same way.
    tokens += [f"<extra_id_{i}>" for i in range(len(weights.word_embeddings) - len(tokens))]
    spec.register_vocabulary(tokens)
    spec.config.unk_token = unk_token
    spec.config.layer_norm_epsilon = weights.epsilon
    return spec


def _set_linear(spec: Any, linear: Linear) -> None:
    spec.weight, spec.bias = linear.weight, linear.bias


def _set_norm(spec: Any, norm: LayerNorm) -> None:
    spec.gamma, spec.beta = norm.gamma, norm.beta


def convert_export(export_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the CTranslate2 model of ``export_dir`` (an fp32 export) into ``out_dir``."""
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    vocab = export_dir / VOCAB_FILE
    if not vocab.is_file():
        raise UnsupportedGraphError(f"no {VOCAB_FILE} in {export_dir} (not a BERT export)")
    spec = build_spec(
        read_bert_weights(export_dir / MODEL_FILE),
        # One token a line; str.splitlines would also split at U+0085, U+2028 and the like.
        vocab.read_text(encoding="utf-8").rstrip("\n").split("\n"),
    )
    spec.validate()
    spec.optimize(quantization="float32")
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", help="an fp32 export folder (model.onnx, vocab.txt)")
    parser.add_argument("out", help="the folder to write the CTranslate2 model into")
    args = parser.parse_args(argv)
    try:
        convert_export(args.export, args.out)
    except UnsupportedGraphError as exc:
        print(f"cannot convert {args.export}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
