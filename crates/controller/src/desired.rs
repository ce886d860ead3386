//! The desired node state the model implies, per subsystem, as plain data. Pure.
