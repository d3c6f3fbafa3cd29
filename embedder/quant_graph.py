"""The onnx graph work behind int8 embedders (:mod:`embedder.quantize`): which nodes a
:class:`~embedder.quantize.QuantRecipe` keeps float, and the bias correction onnxruntime's
quantiser lacks. Graphs in (onnx protos), names or counts out."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

#: the op types the static recipe quantises (ReLU6 is Clip); pooling, mean and L2 stay float
QUANTIZED_OPS = ("Conv", "Clip", "Add")


def input_convs(proto: Any) -> list[str]:
    """Names of the Conv nodes that read the model's input (each stem), kept float: +0.14 R@1 on
    cub-dev for ~2% of the multiply-adds (the pixels' rounding is every later layer's error)."""
    inputs = {i.name for i in proto.graph.input}
    return [n.name for n in proto.graph.node if n.op_type == "Conv" and n.input and n.input[0] in inputs]


def head_nodes(proto: Any) -> list[str]:
    """Names of the quantisable nodes at the float end of each backbone (every Conv/Clip/Add
    next to a float op, and the Conv feeding such a Clip): what ``float_nodes="head"`` keeps."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in proto.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    out: list[str] = []
    for n in proto.graph.node:
        if n.op_type not in QUANTIZED_OPS:
            continue
        src = producer.get(n.input[0]) if n.input else None
        fed_float = src is not None and src.op_type not in QUANTIZED_OPS
        feeds_float = any(c.op_type not in QUANTIZED_OPS for o in n.output for c in consumers.get(o, []))
        if fed_float or feeds_float:
            if n.op_type == "Clip" and src is not None and src.op_type == "Conv" and src.name not in out:
                out.append(src.name)
            if n.name not in out:
                out.append(n.name)
    return out


def full_res_nodes(proto: Any) -> list[str]:
    """Names of the stem conv(s) and every quantisable node whose output keeps a stem output's
    height and width: the layers before the first downsampling. Kept float by ``full-res``: int8
    error made there runs through every later layer (onnxruntime's qdq_loss_debug on Lite1: the
    embedding's SQNR falls from 53 to 17 dB in its first block, then ~1 dB a block), and they are
    ~5% of its multiply-adds. Needs the shapes of onnx's shape inference (``quant_pre_process``)."""
    shapes = {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim)
              for v in proto.graph.value_info}
    stems = set(input_convs(proto))
    sizes = {shapes[n.output[0]][2:] for n in proto.graph.node     # known sizes only (0: dynamic)
             if n.name in stems and len(shapes.get(n.output[0], ())) == 4 and all(shapes[n.output[0]][2:])}
    return [n.name for n in proto.graph.node if n.name in stems or (
        n.op_type in QUANTIZED_OPS and len(shapes.get(n.output[0], ())) == 4
        and shapes[n.output[0]][2:] in sizes)]


def float_node_names(proto: Any, policy: str) -> list[str]:
    """The nodes ``policy`` (:data:`FLOAT_NODES`) keeps float in ``proto``, in graph order."""
    names = set(full_res_nodes(proto) if policy == "full-res" else ())
    if "stem" in policy:
        names.update(input_convs(proto))
    if "head" in policy:
        names.update(head_nodes(proto))
    if "adds" in policy:    # the residual sums (each block's output) kept float
        names.update(n.name for n in proto.graph.node if n.op_type == "Add")
    return [n.name for n in proto.graph.node if n.name in names]


def conv_input_means(fp32: Any, names: Sequence[str], input_name: str,
                     batches: Sequence[np.ndarray], chunk: int = 4) -> dict[str, np.ndarray]:
    """Per-channel means of the tensors ``names`` of the float model ``fp32`` (an onnx proto) over
    the images of ``batches``, run ``chunk`` images at a time (every conv input at once is ~8 MB
    an image for Lite1 at 224 px)."""
    import onnx
    import onnxruntime as ort

    model = onnx.ModelProto()
    model.CopyFrom(fp32)
    known = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names if n not in known)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sums: dict[str, np.ndarray] = {}
    seen = 0
    for batch in batches:
        for i in range(0, len(batch), chunk):
            x = np.ascontiguousarray(batch[i:i + chunk])
            for name, v in zip(names, sess.run(list(names), {input_name: x})):
                sums[name] = sums.get(name, 0) + v.astype(np.float64).sum(axis=(0, *range(2, v.ndim))) / (
                    np.prod(v.shape[2:]) or 1)
            seen += len(x)
    return {n: s / seen for n, s in sums.items()}


def correct_biases(q: Any, fp32: Any, means: dict[str, np.ndarray]) -> int:
    """Bias correction (Nagel et al. 2019, "Data-Free Quantization", 4.2, with empirical means):
    rounding a conv's weights shifts its output by ``(W_q - W) E[x]`` on average, the same sign
    over every image, and 7-bit weights make that shift most of Lite1's int8 error (7-bit weights
    alone, activations float: cosine to fp32 0.985; corrected, the whole int8 model: 0.996;
    docs/benchmarks/quality-round5.md). Each int8 conv of ``q`` whose fp32 twin (same node name in
    ``fp32``, the quantiser's input) has a bias gets ``b - (W_q - W) E[x]`` in its int32 bias;
    ``means`` (:func:`conv_input_means`) holds ``E[x]`` per channel of each twin's input; zero
    padding is ignored. onnxruntime's quantiser has no bias correction, hence this. Returns how
    many convs were corrected."""
    from onnx.numpy_helper import from_array, to_array

    inits = {i.name: i for i in q.graph.initializer}
    producer = {o: n for n in q.graph.node for o in n.output}
    twins = {n.name: n for n in fp32.graph.node if n.op_type == "Conv" and len(n.input) > 2}
    floats = {i.name: i for i in fp32.graph.initializer}
    done = 0
    for n in q.graph.node:
        twin = twins.get(n.name)
        dq_w, dq_b = (producer.get(n.input[i]) if len(n.input) > i else None for i in (1, 2))
        if (twin is None or n.op_type != "Conv" or dq_w is None or dq_b is None
                or dq_w.op_type != "DequantizeLinear" or dq_b.op_type != "DequantizeLinear"):
            continue
        w = to_array(floats[twin.input[1]]).astype(np.float64)
        shape = (-1,) + (1,) * (w.ndim - 1)
        wq, w_scale = (to_array(inits[i]).astype(np.float64) for i in dq_w.input[:2])
        w_zero = to_array(inits[dq_w.input[2]]).astype(np.float64) if len(dq_w.input) > 2 else 0.0
        delta = (wq - np.reshape(w_zero, shape)) * np.reshape(w_scale, shape) - w    # [out, in/group, k...]
        groups = next((a.i for a in n.attribute if a.name == "group"), 1)
        out_ch, per_group = w.shape[:2]
        mean_in = means[twin.input[0]].reshape(groups, per_group)[np.arange(out_ch) // (out_ch // groups)]
        shift = (delta.sum(axis=tuple(range(2, w.ndim))) * mean_in).sum(axis=1)
        bias = to_array(floats[twin.input[2]]).astype(np.float64) - shift
        b_init = inits[dq_b.input[0]]
        b_scale = to_array(inits[dq_b.input[1]]).astype(np.float64)
        b_zero = to_array(inits[dq_b.input[2]]).astype(np.float64) if len(dq_b.input) > 2 else 0.0
        info = np.iinfo(np.int32)
        b_init.CopyFrom(from_array(np.clip(np.round(bias / b_scale + b_zero), info.min, info.max)
                                   .astype(np.int32), b_init.name))
        done += 1
    return done
