"""The one exception type users see from us."""


class CudaMemError(Exception):
    """A problem the user can act on: the message says what happened and what to do.

    Magics catch it and print its message as one line; anything else that escapes is a bug.
    """
