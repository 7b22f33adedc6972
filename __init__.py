"""splitinfer: run one neural network across an edge device and the cloud.

The rooms live in sub-packages: :mod:`splitinfer.shared` (formats both halves
agree on), :mod:`splitinfer.partitioner` (ONNX model -> split package),
:mod:`splitinfer.edge`, :mod:`splitinfer.cloud` and :mod:`splitinfer.sim`.
"""

__version__ = "0.1.0"
