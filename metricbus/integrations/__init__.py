"""Integrations with training frameworks (verl, Ray, Lightning, Hugging Face, Accelerate).

Each module imports its framework lazily, inside the functions that need it: importing ``metricbus`` or this
package never imports a framework.
"""
