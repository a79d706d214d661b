"""The application's errors (configuration and launch): raised by ``gradpool.app`` only, all
:class:`gradpool.GradPoolError` subclasses like the core's."""
from gradpool.errors import GradPoolError


class LaunchError(GradPoolError, RuntimeError):
    """A rank started by ``gradpool.launch`` exited non-zero; the message holds its log tail."""


class ConfigError(GradPoolError, ValueError):
    """A configuration file or override has an unknown key or a bad value."""


class UnknownConfigKeyError(ConfigError):
    """A config file or override names a section or key the schema does not have."""


class ConfigValueError(ConfigError):
    """A config key holds a value of the wrong type or outside its allowed values.

    ``key`` is the full dotted path, ``given`` the offending value, ``allowed`` a short
    description of what the key accepts (all ``None`` for checks that span several keys).
    """

    def __init__(self, message: str, *, key=None, given=None, allowed=None):
        super().__init__(message)
        self.key, self.given, self.allowed = key, given, allowed


class OverrideSyntaxError(ConfigError):
    """A ``--set`` override is not of the form ``section.key=value`` with a scalar value."""
