"""Why an adapter was refused: one error class per cause, each naming the tensor and the fix."""


class AdapterError(ValueError):
    """Base of every adapter problem; `code` is machine-readable, the message says what to do."""

    code = "invalid_adapter"

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class ManifestError(AdapterError):
    code = "bad_manifest"


class UnknownModuleError(AdapterError):
    code = "unknown_module"


class MissingModuleError(AdapterError):
    code = "missing_module"


class ShapeMismatchError(AdapterError):
    code = "shape_mismatch"


class RankLimitError(AdapterError):
    code = "rank_too_large"


class NonFiniteError(AdapterError):
    code = "non_finite"


class BaseModelMismatchError(AdapterError):
    code = "wrong_base_model"


class LayoutError(AdapterError):
    code = "bad_layout"
