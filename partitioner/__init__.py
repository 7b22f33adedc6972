"""From an ONNX model to a split package.

Load and check (:mod:`.loader`), optimize (:mod:`.passes`), analyse shapes and
costs (:mod:`.analysis`, :mod:`.flops`), enumerate cuts (:mod:`.cuts`), extract
the two segments (:mod:`.segments`) and write the package (:mod:`.package`).
"""
