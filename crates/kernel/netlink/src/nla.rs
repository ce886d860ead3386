//! Netlink attribute (TLV) writing and bounds-checked reading.

use crate::consts::{NLA_HDRLEN, NLA_TYPE_MASK};
use crate::Error;

/// Round up to the netlink 4-byte alignment (saturating, so a corrupt length cannot overflow).
pub fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

/// Appends attributes to a message buffer.
pub struct AttrWriter<'a> {
    buf: &'a mut Vec<u8>,
}

impl<'a> AttrWriter<'a> {
    /// Writer appending to `buf`.
    pub fn new(buf: &'a mut Vec<u8>) -> AttrWriter<'a> {
        AttrWriter { buf }
    }

    /// Attribute with raw payload bytes (padded to 4 bytes; the length field excludes padding).
    pub fn bytes(&mut self, ty: u16, payload: &[u8]) {
        let len = NLA_HDRLEN + payload.len();
        // Attribute payloads here are at most a few dozen bytes; lengths always fit u16.
        self.buf
            .extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.pad();
    }

    /// u8 attribute.
    pub fn u8(&mut self, ty: u16, v: u8) {
        self.bytes(ty, &[v]);
    }

    /// u16 attribute in host byte order.
    pub fn u16(&mut self, ty: u16, v: u16) {
        self.bytes(ty, &v.to_ne_bytes());
    }

    /// u16 attribute in network byte order (ports).
    pub fn be16(&mut self, ty: u16, v: u16) {
        self.bytes(ty, &v.to_be_bytes());
    }

    /// u32 attribute in host byte order.
    pub fn u32(&mut self, ty: u16, v: u32) {
        self.bytes(ty, &v.to_ne_bytes());
    }

    /// NUL-terminated string attribute.
    pub fn string(&mut self, ty: u16, s: &str) {
        let len = NLA_HDRLEN + s.len() + 1;
        self.buf
            .extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
        self.pad();
    }

    /// Nested attribute whose contents `f` writes.
    pub fn nested(&mut self, ty: u16, f: impl FnOnce(&mut AttrWriter<'_>)) {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0, 0]);
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        f(&mut AttrWriter { buf: self.buf });
        let len = self.buf.len() - start;
        let bytes = u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes();
        self.buf[start] = bytes[0];
        self.buf[start + 1] = bytes[1];
    }

    fn pad(&mut self) {
        while self.buf.len() % 4 != 0 {
            self.buf.push(0);
        }
    }
}

/// One attribute: type (without flag bits) and payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr<'a> {
    /// Attribute type with `NLA_F_NESTED` / `NLA_F_NET_BYTEORDER` masked off.
    pub ty: u16,
    /// Payload (without padding).
    pub payload: &'a [u8],
}

impl<'a> Attr<'a> {
    /// Payload as u8.
    pub fn as_u8(&self) -> Result<u8, Error> {
        match self.payload {
            [b] => Ok(*b),
            _ => Err(self.bad_len(1)),
        }
    }

    /// Payload as host-order u16.
    pub fn as_u16(&self) -> Result<u16, Error> {
        let b: [u8; 2] = self.payload.try_into().map_err(|_| self.bad_len(2))?;
        Ok(u16::from_ne_bytes(b))
    }

    /// Payload as network-order u16.
    pub fn as_be16(&self) -> Result<u16, Error> {
        let b: [u8; 2] = self.payload.try_into().map_err(|_| self.bad_len(2))?;
        Ok(u16::from_be_bytes(b))
    }

    /// Payload as host-order u32.
    pub fn as_u32(&self) -> Result<u32, Error> {
        let b: [u8; 4] = self.payload.try_into().map_err(|_| self.bad_len(4))?;
        Ok(u32::from_ne_bytes(b))
    }

    /// Payload as host-order u64.
    pub fn as_u64(&self) -> Result<u64, Error> {
        let b: [u8; 8] = self.payload.try_into().map_err(|_| self.bad_len(8))?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Payload as a host-order u32 or u64 (the kernel uses both widths for counters).
    pub fn as_uint(&self) -> Result<u64, Error> {
        match self.payload.len() {
            4 => self.as_u32().map(u64::from),
            8 => self.as_u64(),
            _ => Err(self.bad_len(8)),
        }
    }

    /// Payload as a NUL-terminated (or unterminated) UTF-8 string.
    pub fn as_str(&self) -> Result<&'a str, Error> {
        let bytes = match self.payload.iter().position(|&b| b == 0) {
            Some(nul) => &self.payload[..nul],
            None => self.payload,
        };
        std::str::from_utf8(bytes)
            .map_err(|_| Error::Malformed(format!("attribute {} is not UTF-8", self.ty)))
    }

    /// Iterator over the attributes nested in this one.
    pub fn nested(&self) -> AttrIter<'a> {
        AttrIter::new(self.payload)
    }

    fn bad_len(&self, want: usize) -> Error {
        Error::Malformed(format!(
            "attribute {} has length {}, expected {}",
            self.ty,
            self.payload.len(),
            want
        ))
    }
}

/// Bounds-checked iterator over a run of attributes. Yields an error (then stops) on truncation.
#[derive(Debug, Clone)]
pub struct AttrIter<'a> {
    rest: &'a [u8],
    failed: bool,
}

impl<'a> AttrIter<'a> {
    /// Iterate the attributes in `buf`.
    pub fn new(buf: &'a [u8]) -> AttrIter<'a> {
        AttrIter {
            rest: buf,
            failed: false,
        }
    }
}

impl<'a> Iterator for AttrIter<'a> {
    type Item = Result<Attr<'a>, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.rest.is_empty() {
            return None;
        }
        let fail = |it: &mut Self, what| {
            it.failed = true;
            Some(Err(Error::Truncated(what)))
        };
        let Some(hdr) = self.rest.get(..NLA_HDRLEN) else {
            return fail(self, "attribute header");
        };
        let len = usize::from(u16::from_ne_bytes([hdr[0], hdr[1]]));
        let ty = u16::from_ne_bytes([hdr[2], hdr[3]]) & NLA_TYPE_MASK;
        if len < NLA_HDRLEN {
            self.failed = true;
            return Some(Err(Error::Malformed(format!(
                "attribute {ty} with length {len}"
            ))));
        }
        let Some(payload) = self.rest.get(NLA_HDRLEN..len) else {
            return fail(self, "attribute payload");
        };
        let advance = align4(len).min(self.rest.len());
        self.rest = &self.rest[advance..];
        Some(Ok(Attr { ty, payload }))
    }
}
