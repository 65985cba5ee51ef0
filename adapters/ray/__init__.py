"""Placing runtime parts as Ray actors."""
