"""A name -> implementation table whose lookups fail naming the config key and the allowed names."""
from __future__ import annotations


class Registry(dict):
    def __init__(self, config_key: str):
        super().__init__()
        self.config_key = config_key

    def register(self, name: str):
        """Decorator: add the decorated function or class under `name`."""
        def add(obj):
            if name in self:
                raise ValueError(f"{self.config_key}: '{name}' is registered twice")
            self[name] = obj
            return obj
        return add

    def lookup(self, name: str):
        if name not in self:
            raise ValueError(f"{self.config_key}: unknown '{name}'; allowed: {', '.join(sorted(self))}")
        return self[name]
