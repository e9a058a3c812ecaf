import pytest
import torch

from llmtailor.training_example import corpus_tokens


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    """The real corpus (pydoc_data.topics) as byte tokens."""
    return corpus_tokens()
