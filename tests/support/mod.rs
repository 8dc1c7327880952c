#![allow(dead_code, unreachable_pub)]

pub mod binary;
pub mod fault;
pub mod faulty;
pub mod keys;
pub mod mcp;
pub mod otlp;
pub mod postgres_server;
pub mod proxy;
pub mod raw;
pub mod redis_server;
pub mod store_fixtures;
pub mod tokens;
pub mod upstream;
