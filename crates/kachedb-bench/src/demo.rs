//! `kachedb-bench demo`: a put in one process, a get in another, every byte checked.

use crate::spawn::DaemonProcess;
use clap::Args;
use kachedb_client::{Client, ConnectOptions, DType, Key, Shape, Value};
use kachedb_shm::units::{human_bytes, parse_size};
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

/// Options of `kachedb-bench demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Use the daemon at this socket instead of starting one.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Bytes of the demo tensor (float16, shape [2, layers, heads, tokens, 128]).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub bytes: u64,
}

/// Options of the demo's child processes.
#[derive(Debug, Args)]
pub struct DemoChildArgs {
    /// `put` or `get`.
    #[arg(long)]
    pub role: String,
    /// Daemon socket.
    #[arg(long)]
    pub socket: PathBuf,
    /// Elements along the token axis.
    #[arg(long)]
    pub tokens: u64,
}

const LAYERS: u64 = 32;
const HEADS: u64 = 8;
const HEAD_DIM: u64 = 128;

fn shape(tokens: u64) -> Shape {
    Shape::new(&[2, LAYERS, HEADS, tokens, HEAD_DIM]).expect("5 dims fit")
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(2654435761) >> 13) as u8
}

/// Runs the demo.
pub fn run(a: &DemoArgs) -> Result<(), Box<dyn std::error::Error>> {
    let per_token = 2 * LAYERS * HEADS * HEAD_DIM * 2;
    let tokens = (a.bytes / per_token).max(1);
    let bytes = tokens * per_token;
    let (_daemon, socket) = match &a.socket {
        Some(s) => (None, s.clone()),
        None => {
            eprintln!("demo: starting a daemon with a {} megaslab", human_bytes(bytes * 2 + (64 << 20)));
            let d = DaemonProcess::spawn(bytes * 2 + (64 << 20), &[])?;
            let s = d.socket().to_path_buf();
            (Some(d), s)
        }
    };
    let exe = std::env::current_exe()?;
    for role in ["put", "get"] {
        let status = Command::new(&exe)
            .args(["demo-child", "--role", role, "--socket"])
            .arg(&socket)
            .args(["--tokens", &tokens.to_string()])
            .status()?;
        if !status.success() {
            return Err(format!("the {role} process failed ({status})").into());
        }
    }
    let stats = kachedb_client::daemon_stats(&ConnectOptions { socket: Some(socket), ..Default::default() })?;
    println!(
        "demo: done — daemon holds {} block(s), {} used, {} pin(s)",
        stats.store.blocks,
        human_bytes(stats.store.bytes_used),
        stats.store.pins
    );
    Ok(())
}

/// One side of the demo.
pub fn child(a: &DemoChildArgs) -> Result<(), Box<dyn std::error::Error>> {
    let kc = Client::connect(&ConnectOptions { socket: Some(a.socket.clone()), ..Default::default() })?;
    let key = Key::from_bytes(b"demo/prefix-0");
    let shape = shape(a.tokens);
    let len = shape.len_bytes(DType::F16).ok_or("shape overflow")? as usize;
    match a.role.as_str() {
        "put" => {
            let src: Vec<u8> = (0..len).map(pattern).collect();
            let t = Instant::now();
            kc.put(key, Value::tensor(DType::F16, shape, &src))?;
            let dt = t.elapsed();
            println!(
                "demo: pid {} put f16{:?} ({}) in {:.1} ms ({:.2} GB/s)",
                std::process::id(),
                shape.dims(),
                human_bytes(len as u64),
                dt.as_secs_f64() * 1e3,
                len as f64 / dt.as_secs_f64() / 1e9
            );
        }
        "get" => {
            let t = Instant::now();
            let view = kc.get(key)?.ok_or("the block is not there")?;
            let dt = t.elapsed();
            let ok = view.iter().enumerate().all(|(i, &b)| b == pattern(i));
            println!(
                "demo: pid {} got a zero-copy view of f16{:?} ({}) in {:.1} µs; bytes match: {ok}",
                std::process::id(),
                view.shape().dims(),
                human_bytes(view.len() as u64),
                dt.as_secs_f64() * 1e6
            );
            if !ok {
                return Err("bytes differ".into());
            }
        }
        r => return Err(format!("unknown role {r}").into()),
    }
    Ok(())
}
