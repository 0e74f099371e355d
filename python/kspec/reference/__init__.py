"""Float64 NumPy references: the Python twins of the C++ references in api/ops/<family>/reference.cpp."""
