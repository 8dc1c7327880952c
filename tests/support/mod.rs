#![allow(dead_code)]

pub mod proxy;
pub mod upstream;
