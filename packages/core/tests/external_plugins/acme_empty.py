"""A module that registers nothing: loading it as a backend module must fail clearly."""
