//! A minimal writer for the `newc` cpio format the Linux kernel unpacks as an initramfs.

use std::io::{self, Read, Write};

/// Regular-file type bits.
pub const S_IFREG: u32 = 0o100_000;
/// Directory type bits.
pub const S_IFDIR: u32 = 0o040_000;
/// Symlink type bits.
pub const S_IFLNK: u32 = 0o120_000;
/// Character-device type bits.
pub const S_IFCHR: u32 = 0o020_000;

/// Streams `newc` entries to `W`. Names are relative (no leading `/`).
pub struct CpioWriter<W: Write> {
    out: W,
    next_ino: u32,
    written: u64,
}

impl<W: Write> CpioWriter<W> {
    /// Start an archive.
    pub fn new(out: W) -> Self {
        CpioWriter {
            out,
            next_ino: 1,
            written: 0,
        }
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad4(&mut self) -> io::Result<()> {
        let pad = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..pad])
    }

    fn header(&mut self, name: &str, mode: u32, size: u64, rdev: (u32, u32)) -> io::Result<()> {
        let size = u32::try_from(size)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file too large for cpio"))?;
        let name = name.trim_start_matches('/');
        let namesize = name.len() + 1;
        let ino = self.next_ino;
        self.next_ino += 1;
        let nlink = if mode & S_IFDIR == S_IFDIR { 2 } else { 1 };
        let fields = [
            ino,
            mode,
            0,
            0,
            nlink,
            0,
            size,
            0,
            0,
            rdev.0,
            rdev.1,
            namesize as u32,
            0,
        ];
        let mut h = String::with_capacity(110);
        h.push_str("070701");
        for v in fields {
            h.push_str(&format!("{v:08x}"));
        }
        self.put(h.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad4()
    }

    /// Add a directory.
    pub fn dir(&mut self, name: &str, perm: u32) -> io::Result<()> {
        self.header(name, S_IFDIR | (perm & 0o7777), 0, (0, 0))
    }

    /// Add a symlink `name -> target`.
    pub fn symlink(&mut self, name: &str, target: &str) -> io::Result<()> {
        self.header(name, S_IFLNK | 0o777, target.len() as u64, (0, 0))?;
        self.put(target.as_bytes())?;
        self.pad4()
    }

    /// Add a character device node.
    pub fn char_dev(&mut self, name: &str, perm: u32, major: u32, minor: u32) -> io::Result<()> {
        self.header(name, S_IFCHR | (perm & 0o7777), 0, (major, minor))
    }

    /// Add a regular file whose content is `len` bytes read from `data`.
    pub fn file(&mut self, name: &str, perm: u32, len: u64, data: &mut dyn Read) -> io::Result<()> {
        self.header(name, S_IFREG | (perm & 0o7777), len, (0, 0))?;
        let copied = io::copy(&mut data.take(len), &mut self.out)?;
        if copied != len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{name}: expected {len} bytes, read {copied}"),
            ));
        }
        self.written += copied;
        self.pad4()
    }

    /// Write the trailer, pad to 512 bytes and return the sink.
    pub fn finish(mut self) -> io::Result<W> {
        self.header("TRAILER!!!", 0, 0, (0, 0))?;
        let pad = ((512 - (self.written % 512)) % 512) as usize;
        self.put(&vec![0u8; pad])?;
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::process::{Command, Stdio};

    /// Cross-check against GNU cpio: it must list and extract what we wrote.
    #[test]
    fn gnu_cpio_extracts_our_archive() {
        let dir = std::env::temp_dir().join(format!("xtask-cpio-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let mut w = CpioWriter::new(Vec::new());
        w.dir("a", 0o755).unwrap();
        w.dir("a/b", 0o700).unwrap();
        let body = b"hello, initramfs\n".repeat(7);
        w.file("a/b/f.txt", 0o640, body.len() as u64, &mut &body[..])
            .unwrap();
        w.file("a/odd", 0o755, 3, &mut &b"xyz"[..]).unwrap();
        w.symlink("a/link", "b/f.txt").unwrap();
        let archive = w.finish().unwrap();
        assert_eq!(archive.len() % 512, 0);

        let mut child = Command::new("cpio")
            .args(["-id", "--quiet", "--no-absolute-filenames"])
            .current_dir(&dir)
            .stdin(Stdio::piped())
            .spawn()
            .expect("GNU cpio must be installed (cargo xtask installs it)");
        use std::io::Write as _;
        child.stdin.take().unwrap().write_all(&archive).unwrap();
        assert!(child.wait().unwrap().success());

        assert_eq!(fs::read(dir.join("a/b/f.txt")).unwrap(), body);
        assert_eq!(fs::read(dir.join("a/odd")).unwrap(), b"xyz");
        assert_eq!(
            fs::read_link(dir.join("a/link")).unwrap().to_str().unwrap(),
            "b/f.txt"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(dir.join("a/b/f.txt"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o640);
        assert_eq!(fs::read(dir.join("a/link")).unwrap(), body);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn truncated_reader_is_an_error() {
        let mut w = CpioWriter::new(Vec::new());
        let err = w.file("short", 0o644, 10, &mut &b"abc"[..]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
