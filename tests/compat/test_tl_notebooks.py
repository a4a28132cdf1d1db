"""What TransformerLens' demo notebooks print or compute, where benchmarks/tl_notebooks.py found this bridge
differing from TransformerLens 4.3's (issue #32, item 5); each checked against TransformerLens' documented output
written out by hand."""

import torch

from transformer_bridge.compat.factored import FactoredMatrix


def test_factored_matrix_prints_as_transformerlens():
    # Main_Demo prints `model.OV` and `W_E @ OV @ W_U`: TransformerLens shows the torch.Size and the hidden dim.
    m = FactoredMatrix(torch.ones(4, 9, 576, 64), torch.ones(4, 9, 64, 576))
    assert repr(m) == "FactoredMatrix: Shape(torch.Size([4, 9, 576, 576])), Hidden Dim(64)"
    assert str(m @ torch.ones(576, 7)) == "FactoredMatrix: Shape(torch.Size([4, 9, 576, 7])), Hidden Dim(64)"
    assert str(m[0, 1]) == "FactoredMatrix: Shape(torch.Size([576, 576])), Hidden Dim(64)"
