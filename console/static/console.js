// The console's only script (its Content-Security-Policy allows no inline script or handler).
//
// A form with data-confirm asks before it is sent. One listener on the document, so a form
// swapped in by the live update below asks too.
document.addEventListener("submit", function (event) {
  var form = event.target;
  var question = form && form.dataset ? form.dataset.confirm : null;
  if (question && !window.confirm(question)) event.preventDefault();
});

// Live updates of a running session's page, without a reload and without a build step: while
// the session's tree still runs (data-active="true"), fetch its server-rendered live part
// every second and swap it in. Stops once the tree is settled (one last swap shows the end).
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) return;
  var INTERVAL_MS = 1000;
  function tick() {
    fetch(live.dataset.src, { credentials: "same-origin", headers: { Accept: "text/html" } })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (html) {
        live.innerHTML = html;
        var summary = live.querySelector(".summary");
        var active = summary ? summary.dataset.active : "false";
        live.dataset.active = active;
        live.dataset.updatedAt = String(Date.now());
        if (active === "true") setTimeout(tick, INTERVAL_MS);
      })
      .catch(function () { setTimeout(tick, INTERVAL_MS * 3); });
  }
  if (live.dataset.active === "true") setTimeout(tick, INTERVAL_MS);
})();
