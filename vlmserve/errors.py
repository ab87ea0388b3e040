"""Errors a user can cause. Each is a ValueError so callers can catch them together."""


class InvalidRequestError(ValueError):
    """A request was rejected at admission; the message names the problem."""


class InvalidImageError(InvalidRequestError):
    """An image could not be loaded or decoded, or has an unusable size."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus image tokens) does not fit in the model's context."""
