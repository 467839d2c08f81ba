"""Other forms of the fp32 export's attention, written as export folders for ``ab_servers.py``.

- ``mha``: each fused ``Attention`` node (whose CPU kernel projects Q, K and V head by head,
  36 products of 32 columns a batch row) becomes one ``MatMul`` of 1152 columns, a ``Split``
  and ``MultiHeadAttention`` with the bias and the key-length mask;
- ``onnx24``: the same product, bias and ``Split``, then the ONNX standard ``Attention``
  (opset 24), whose ``nonpad_kv_seqlen`` input (each row's token count) stands for the mask;
  the graph's other operators move to opset 24 with it (the ``Reduce*`` axes become inputs);
- ``unfused``: the graph exported again with onnxruntime's attention fusion off (``MatMul``,
  ``Softmax``, ``Transpose`` and ``Add`` for the mask); needs the ``export`` extra (torch).

Everything else (tokenizer, manifest) is the export's own, the manifest's checksum of the
graph excepted. None is what ``sde2-reward
export`` writes: they exist to be measured against it (``benchmarks/README.md``, thirteenth
and fourteenth passes).

    python benchmarks/graph_variants.py /tmp/variants
    python benchmarks/ab_servers.py onnx "onnx model=/tmp/variants/mha" \\
        "onnx model=/tmp/variants/onnx24" "onnx model=/tmp/variants/unfused"
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reward_server.encoders.base import EMBEDDING_DIM
from reward_server.encoders.model_store import MANIFEST_FILE, MODEL_FILE, resolve_model, sha256_file

NUM_HEADS = 12
#: The ONNX opset whose ``Attention`` takes ``nonpad_kv_seqlen``.
ONNX_ATTENTION_OPSET = 24


def _with_graph(export: Path, out: Path, save: Callable[[str], object]) -> None:
    """A fresh copy of the export folder at ``out`` whose graph ``save`` writes (given the
    path), its manifest's checksum of the graph updated: servers check it at load."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export, out)
    save(str(out / MODEL_FILE))
    manifest = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    manifest.setdefault("files", {})[MODEL_FILE] = sha256_file(out / MODEL_FILE)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def write_mha(export: Path, out: Path) -> Counter[str]:
    """The ``mha`` variant of ``export`` at ``out``; returns its operator counts."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(export / MODEL_FILE))
    graph = model.graph
    graph.initializer.append(
        numpy_helper.from_array(np.full(3, EMBEDDING_DIM, dtype=np.int64), "qkv_split")
    )
    nodes: list[Any] = []
    for node in graph.node:
        if node.op_type != "Attention":
            nodes.append(node)
            continue
        hidden, weight, bias, mask = node.input
        out_name = node.output[0]
        qkv, q, k, v = (f"{out_name}_{s}" for s in ("qkv", "q", "k", "v"))
        nodes += [
            helper.make_node("MatMul", [hidden, weight], [qkv], name=f"{node.name}_qkv"),
            helper.make_node("Split", [qkv, "qkv_split"], [q, k, v], axis=-1),
            helper.make_node(
                "MultiHeadAttention",
                [q, k, v, bias, mask],
                [out_name],
                domain="com.microsoft",
                num_heads=NUM_HEADS,
                name=f"{node.name}_mha",
            ),
        ]
    del graph.node[:]
    graph.node.extend(nodes)
    _with_graph(export, out, partial(onnx.save, model))
    return Counter(n.op_type for n in nodes)


def write_onnx24(export: Path, out: Path) -> Counter[str]:
    """The ``onnx24`` variant of ``export`` at ``out``; returns its operator counts."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(export / MODEL_FILE))
    graph = model.graph
    for name, value in (("qkv_split", [EMBEDDING_DIM] * 3), ("row_axis", [1])):
        graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
    lengths = "nonpad_kv_seqlen"
    nodes: list[Any] = [
        helper.make_node("ReduceSum", ["attention_mask", "row_axis"], [lengths], keepdims=0)
    ]
    for index, node in enumerate(graph.node):
        axes = next((a for a in node.attribute if a.name == "axes"), None)
        if node.op_type.startswith("Reduce") and axes is not None:  # an input from opset 18
            name = f"reduce_axes_{index}"
            graph.initializer.append(numpy_helper.from_array(np.array(axes.ints, np.int64), name))
            node.attribute.remove(axes)
            node.input.append(name)
        if node.op_type != "Attention":
            nodes.append(node)
            continue
        hidden, weight, bias, _mask = node.input
        out_name = node.output[0]
        qkv, biased, q, k, v = (f"{out_name}_{s}" for s in ("qkv", "biased", "q", "k", "v"))
        nodes += [
            helper.make_node("MatMul", [hidden, weight], [qkv], name=f"{node.name}_qkv"),
            helper.make_node("Add", [qkv, bias], [biased]),
            helper.make_node("Split", [biased, "qkv_split"], [q, k, v], axis=-1),
            helper.make_node(
                "Attention",
                [q, k, v, "", "", "", lengths],
                [out_name],
                q_num_heads=NUM_HEADS,
                kv_num_heads=NUM_HEADS,
                name=f"{node.name}_onnx",
            ),
        ]
    del graph.node[:]
    graph.node.extend(nodes)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = ONNX_ATTENTION_OPSET
    _with_graph(export, out, partial(onnx.save, model))
    return Counter(n.op_type for n in nodes)


def write_unfused(export: Path, out: Path) -> Counter[str]:
    """The ``unfused`` variant at ``out`` (exported again from the offline package's weights)."""
    from onnxruntime.transformers.optimizer import optimize_model

    from reward_server.encoders.onnx_export import (
        _export_graph,
        fusion_options,
        load_reference,
        resolve_source,
    )

    options = fusion_options(gpu=False)
    options.enable_attention = False
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.onnx"
        _export_graph(load_reference(resolve_source(None).folder), raw, opset=17)
        fused = optimize_model(
            str(raw),
            model_type="bert",
            num_heads=NUM_HEADS,
            hidden_size=EMBEDDING_DIM,
            use_gpu=False,
            optimization_options=options,
        )
        _with_graph(export, out, fused.save_model_to_file)
    return Counter(n.op_type for n in fused.model.graph.node)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the variants' folders into")
    parser.add_argument("--model", default=None, help="exported ONNX folder (default: embedded)")
    args = parser.parse_args(argv)
    export = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    writers = (("mha", write_mha), ("onnx24", write_onnx24), ("unfused", write_unfused))
    for name, write in writers:
        ops = write(export, args.out / name)
        print(f"{args.out / name}: {dict(ops.most_common(6))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
